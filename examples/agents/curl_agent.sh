#!/usr/bin/env bash
# An agent with no Python in it: bash, curl and jq against the episode's OpenAI endpoint.
#
#   OPENAI_BASE_URL=http://127.0.0.1:PORT/s/<episode>/v1 bash curl_agent.sh "What is 3+4?"
#
# It asks the question, sends the answer back with a request to check it, and prints the
# second answer on stdout. The answer goes back as the endpoint returned it (its role, content
# and any tool calls, untouched), so the second call continues the episode's trajectory token
# for token instead of starting a new one. A refused call (HTTP 400: a limit of the episode)
# ends the script with status 1 and the endpoint's reason on stderr.
set -euo pipefail

question=${1:?usage: curl_agent.sh QUESTION}

chat() {  # chat MESSAGES_JSON: the response body of one chat completion
  local body reply status
  body=$(jq -n --argjson messages "$1" '{model: "policy", messages: $messages, max_tokens: 64}')
  reply=$(curl --silent --show-error --max-time 60 --write-out '\n%{http_code}' \
    -H "Authorization: Bearer ${OPENAI_API_KEY:-none}" \
    -H 'Content-Type: application/json' \
    --data "$body" "$OPENAI_BASE_URL/chat/completions")
  status=${reply##*$'\n'}
  reply=${reply%$'\n'*}
  if [[ $status != 200 ]]; then
    echo "HTTP $status: $(jq -r '.error.message // .' <<<"$reply")" >&2
    exit 1
  fi
  printf '%s' "$reply"
}

messages=$(jq -n --arg question "$question" '[{role: "user", content: $question}]')
response=$(chat "$messages")
answer=$(jq '.choices[0].message' <<<"$response")
messages=$(jq --argjson answer "$answer" \
  '. + [$answer, {role: "user", content: "Check it, and give the final answer only."}]' \
  <<<"$messages")
response=$(chat "$messages")
jq -r '.choices[0].message.content // ""' <<<"$response"
