"""An environment whose answers are tool results: the policy calls tools until it answers.

A turn without a call is the final answer. Every call is answered with one ``tool`` turn: the
result, or an error the model can read, counted by kind. Calls run in worker processes,
concurrently across episodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from grpo.config.options import checked_options
from grpo.config.sections import REWARD_TIMEOUT_S, RewardTimeout
from grpo.envs.base import Episode, Message, MultiTurnEnv, PendingResponse
from grpo.envs.dropped import failure_reason
from grpo.envs.protocol import FailedEpisodes
from grpo.envs.runner import ToolRunner, default_tool_runner, tool_outcome
from grpo.envs.tools import (
    BAD_ARGUMENTS,
    CALL_FORMATS,
    PARSE_ERROR,
    UNKNOWN_TOOL,
    Tool,
    call_format_problem,
    call_stop_strings,
    parse_tool_calls,
    resolve_tools,
)
from grpo.process_pool import Job, jobs_deadline


class ToolEnv(MultiTurnEnv):
    """The policy calls tools (plain Python functions) over several turns, then answers.

    Args:
        tools (Sequence): Functions with type hints, their dotted paths, or `Tool` objects,
            e.g. ``[grpo.envs.builtin_tools.calculator]``.
        call_format (str): How the model writes its calls, the format its chat template
            teaches (`grpo.envs.tools.CALL_FORMATS`).
        tool_timeout_s (float): Seconds one call may take from when a worker takes it; a
            slower call is stopped and answered with an error.
        max_tool_calls_per_turn (int): Calls of one turn beyond this are answered with an
            error without running.
        tool_memory_mb (int | None): Data memory one call may allocate; past it the call
            fails with ``MemoryError``. None: no cap. Ignored with a ``runner`` of your own.
        tool_workers (int): Worker processes that run the calls, shared by every episode of
            the collector. Ignored with a ``runner`` of your own.
        failed_episodes (str): As `MultiTurnEnv`; default ``"score"``: a turn that makes the
            call parser raise is the policy's doing, and is penalised.
        stop (Sequence[str] | None): Stop strings of a policy turn; default the end of a call,
            so a turn ends as soon as it has made its call.

    Raises:
        ValueError: An option of the wrong type or out of bounds, a tool `Tool` refuses, no
            tools.
    """

    env_roles = ("tool",)  # every answer is one tool turn per call

    @checked_options
    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any] | str],
        call_format: Annotated[Literal[CALL_FORMATS], Field()] = "json",
        tool_timeout_s: Annotated[float, Field(gt=0)] = 5.0,
        max_tool_calls_per_turn: Annotated[int, Field(ge=1)] = 4,
        tool_memory_mb: Annotated[int, Field(ge=64)] | None = 2048,
        tool_workers: Annotated[int, Field(ge=1)] = 2,
        runner: ToolRunner | None = None,
        reward_functions: Sequence[Any] = (),
        max_turns: Annotated[int, Field(ge=1)] = 4,
        max_episode_tokens: Annotated[int, Field(ge=1)] | None = None,
        max_tokens_per_turn: Annotated[int, Field(ge=1)] | None = None,
        stop: Annotated[Sequence[str], Field()] | None = None,
        reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S,
        failed_episodes: Annotated[FailedEpisodes, Field()] = "score",
    ) -> None:
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        self.tools = resolve_tools(tools)
        for tool in self.tools.values():
            if problem := call_format_problem(call_format, tool):
                raise ValueError(problem)
        # A policy turn stops right after a call: the result comes before the model goes on.
        if stop is None:
            stop = call_stop_strings(call_format, list(self.tools))
        super().__init__(
            reward_functions=reward_functions,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            max_tokens_per_turn=max_tokens_per_turn,
            stop=stop,
            reward_timeout_s=reward_timeout_s,
            failed_episodes=failed_episodes,
        )
        self.call_format = call_format
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.tool_memory_mb = tool_memory_mb
        self.tool_workers = tool_workers
        self.runner = runner

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as chat templates list them (``apply_chat_template(tools=...)``)."""
        return [tool.schema() for tool in self.tools.values()]

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        return self.start_response(episode).result()

    def start_response(self, episode: Episode) -> PendingResponse:
        """Parse the turn's calls and start the good ones on the workers; answer the rest now,
        one tool turn per call, in order. No call: the episode ends."""
        try:
            calls = parse_tool_calls(episode.last_assistant_text(), self.call_format, self.tools)
        except Exception as error:  # the run goes on; the episode ends here, named
            episode.error = failure_reason(error)
            return PendingResponse(None)
        if not calls:
            return PendingResponse(None)  # no call: this turn is the answer
        runner = self.runner or default_tool_runner(self.tool_memory_mb, self.tool_workers)
        turns: list[Message] = []
        jobs: list[tuple[int, Job]] = []  # (position in turns, job) of each running call
        for number, call in enumerate(calls):
            episode.tool_calls += 1
            problem, kind = self._refusal(call, number)
            if problem is not None:
                episode.count_tool_error(kind)
                turns.append({"role": "tool", "content": f"error: {problem}"})
                continue
            job = runner.submit(self.tools[call.name], call.arguments, self.tool_timeout_s)
            jobs.append((len(turns), job))
            turns.append({"role": "tool", "content": ""})

        def finish() -> None:
            for position, job in jobs:
                outcome = tool_outcome(job)
                content = outcome.text
                if outcome.error is not None:
                    episode.count_tool_error(outcome.error)
                    content = f"error: {outcome.text}"
                turns[position]["content"] = content
                if job.queue_wait_s is not None:
                    episode.tool_queue_waits.append(job.queue_wait_s)

        running = [job for _, job in jobs]
        return PendingResponse(
            turns,
            [job.future for job in running],
            finish,
            # Moves as queued calls start: each call's clock starts when a worker takes it.
            deadline=lambda: jobs_deadline(running),
        )

    def _refusal(self, call: Any, number: int) -> tuple[str | None, str]:
        """Why a parsed call is answered with an error without running, and its kind."""
        if call.error is not None:
            return call.error, PARSE_ERROR
        if number >= self.max_tool_calls_per_turn:
            return f"at most {self.max_tool_calls_per_turn} tool calls per turn", BAD_ARGUMENTS
        if call.name not in self.tools:
            return f"no tool named {call.name!r}; tools: {sorted(self.tools)}", UNKNOWN_TOOL
        problem = self.tools[call.name].check_arguments(call.arguments)
        return problem, BAD_ARGUMENTS
