"""The README and the docs pages work on this checkout.

Every fenced block and code span of README.md and docs/*.md is checked:

* shell blocks, each command: ``grpo run`` and ``grpo validate`` pass ``grpo validate`` with
  their overrides (a tiny model folder and a cluster size stand in where this machine has
  none), ``grpo cp`` and ``grpo ls`` run, ``python scripts/X.py`` names a script and options
  it takes, ``make`` a target of the Makefile, ``pip install`` extras of pyproject.toml.
* yaml blocks: laid over a shipped config (the demo's first), the result passes
  ``grpo validate``; a node with a ``_component_`` replaces the config's node, a section is
  merged into it.
* python blocks: pyflakes finds nothing, and they run; a block whose first line is
  ``# NAME.py`` is imported as that module, which yaml blocks may name
  (``my_rewards.short_answer``).
* code spans: repo paths exist, ``grpo.*`` names import, ``key=value`` overrides name keys of
  the config, and commands are checked as in shell blocks.
* links: the file and the heading they point to exist.

And the README: the two commands, a link to every docs page, its config an
excerpt of the demo's, its tables of figures those of docs/benchmarks.md. Blocks without a
language (terminal output, diagrams) are shown, not run.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
BASE_CONFIG = REPO / "configs" / "tiny_arithmetic_cpu.yaml"

# Names the docs use for the reader's own modules and files, and what stands for them here.
STAND_INS = {"my_package.my_taskset": "grpo.testing.verifiers_arithmetic"}
# Programs the docs show that belong to other projects.
EXTERNAL = {"ray"}


# --------------------------------------------------------------------------------------------
# Reading the pages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    start = lang = None
    for number, line in enumerate(lines, 1):
        if not line.startswith("```"):
            continue
        if start is None:
            start, lang = number, line[3:].strip()
        else:
            blocks.append(Block(page, start, lang, "\n".join(lines[start : number - 1]) + "\n"))
            start = None
    assert start is None, f"{page}: the block opened at line {start} is never closed"
    return blocks


def _prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)


def _spans(page: Path) -> list[str]:
    """Inline code spans, whitespace (line breaks included) collapsed."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", _prose(page))]


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(page))


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+\s+(.*)$", _prose(page), flags=re.MULTILINE)
    return {_slug(heading) for heading in headings}


def _all_blocks(*langs: str) -> list[Block]:
    return [block for page in PAGES for block in _blocks(page) if block.lang in langs]


def _params(blocks: list[Block]):
    return [pytest.param(block, id=block.id) for block in blocks]


PAGE_PARAMS = [pytest.param(page, id=str(page.relative_to(REPO))) for page in PAGES]


# --------------------------------------------------------------------------------------------
# Checking one command
# --------------------------------------------------------------------------------------------


def _is_placeholder(value: str) -> bool:
    """A value the reader picks: ``N``, ``RUN_DIR``, ``K/S``."""
    return re.fullmatch(r"[A-Z][A-Z_]*(/[A-Z][A-Z_]*)*", value) is not None


def _placeholder(token: str) -> str:
    """``seed=N`` -> ``seed=1``."""
    key, sep, value = token.partition("=")
    return f"{key}=1" if sep and _is_placeholder(value) else token


def _config_file(name_or_path: str, folder: Path) -> Path:
    if name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        return path if path.is_absolute() else folder / path
    return REPO / "configs" / f"{name_or_path}.yaml"


def _stand_ins(config: Path, overrides: list[str], model: Path) -> list[str]:
    """Overrides that stand in for a model folder and a cluster this machine does not have."""
    values = yaml.safe_load(config.read_text()) if config.is_file() else {}
    given = dict(override.split("=", 1) for override in overrides if "=" in override)
    folder = Path(given.get("base_model_path", values.get("base_model_path", "")))
    # Only a model the repo ships is used as is: a folder elsewhere (a download in /tmp) may
    # or may not be on this machine, and the check must not depend on it.
    if not folder.is_absolute() and (REPO / folder).is_dir():
        return []
    stand_ins = [f"base_model_path={model}"]
    if "ray.address" not in given and (values.get("ray") or {}).get("address") is None:
        stand_ins += ["ray.num_cpus=64", "ray.num_gpus=8"]
    return stand_ins


@pytest.fixture(scope="module")
def stand_in_model(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-like model folder (its chat template calls tools) with a long context."""
    from grpo.testing import build_tiny_qwen2

    folder = tmp_path_factory.mktemp("stand_in") / "model"
    return build_tiny_qwen2(folder, tool_calls=True, max_seq_len=32768)


def _grpo(argv: list[str]) -> tuple[int, str]:
    """Run the ``grpo`` command in this process: its exit status and what it printed."""
    from grpo.cli import main

    out, path = io.StringIO(), list(sys.path)  # it puts the working folder on the path
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse: --version, --help, usage errors
            status = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            sys.path[:] = path
    return status, out.getvalue()


def _validate(config: str, overrides: list[str], folder: Path, model: Path) -> None:
    """``grpo validate CONFIG OVERRIDES``, run in `folder`, passes, into a fresh run folder."""
    overrides = [_placeholder(override) for override in overrides]
    # A resume needs a run to resume: the rest of the command is checked.
    overrides = [o for o in overrides if not o.startswith("resume_from_checkpoint=")]
    stand_ins = _stand_ins(_config_file(config, folder), overrides, model)
    run_dir = folder / f"run{len(list(folder.glob('run*')))}"
    argv = ["validate", config, *overrides, *stand_ins, f"output_dir={run_dir}"]
    status, output = _grpo(argv)
    assert status == 0, f"grpo {shlex.join(argv)}:\n{output}"


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, flags=re.MULTILINE))


def _extras() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.MULTILINE))


def _script_options(script: Path) -> dict[str, list[str] | None]:
    """A script's ``--options`` (from its ``add_argument`` calls) and their literal choices."""
    options: dict[str, list[str] | None] = {}
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        choices = None
        for keyword in node.keywords:
            if keyword.arg == "choices" and isinstance(keyword.value, ast.List | ast.Tuple):
                choices = [ast.literal_eval(element) for element in keyword.value.elts]
        for name in names:
            if isinstance(name, str) and name.startswith("-"):
                options[name] = choices
    return options


def _check_script(path: str, args: list[str]) -> None:
    script = REPO / path
    assert script.is_file(), f"{path} does not exist"
    options = _script_options(script)
    for index, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        name, _, value = arg.partition("=")
        assert name in options, f"{path} takes no option {name} (it takes {sorted(options)})"
        choices = options[name]
        if choices is not None:
            value = value or (args[index + 1] if index + 1 < len(args) else "")
            assert value in choices, f"{path} {name}: {value!r} is not one of {choices}"


@dataclass
class Shell:
    """Checks commands run one after the other in `folder` (``grpo cp`` writes a config there
    that a later ``grpo validate`` reads)."""

    folder: Path  # the working folder
    model: Path  # stands in for a model folder this machine does not have

    def check(self, argv: list[str]) -> None:
        program, args = argv[0], argv[1:]
        if program == "grpo":
            self._grpo(args)
        elif program == "python":
            if args[0].startswith("recipes/"):
                assert (REPO / args[0]).is_file(), f"{args[0]} does not exist"
                config = args[args.index("--config") + 1]
                rest = args[args.index("--config") + 2 :]
                _validate(str(REPO / config), rest, self.folder, self.model)
            else:
                _check_script(args[0], args[1:])
        elif program == "make":
            targets = [arg for arg in args if "=" not in arg]
            assert set(targets) <= _make_targets(), f"make {targets}: no such target"
        elif program == "pip":
            assert args[:2] == ["install", "-e"], shlex.join(argv)
            extras = re.fullmatch(r"\.\[([\w,-]+)\]", args[2]).group(1).split(",")
            assert set(extras) <= _extras(), f"pyproject.toml has no extra among {extras}"
        elif program == "tune":  # tune download REPO --output-dir DIR: a shipped config's model
            folder = args[args.index("--output-dir") + 1]
            models = {
                yaml.safe_load(path.read_text()).get("base_model_path")
                for path in (REPO / "configs").glob("*.yaml")
            }
            assert folder in models, f"no shipped config reads the model folder {folder}"
        else:
            assert program in EXTERNAL, f"a command the docs tests do not know: {argv}"

    def _grpo(self, args: list[str]) -> None:
        if args == ["ls"]:
            status, output = _grpo(["ls"])
            assert status == 0 and "async_grpo" in output, output
        elif args == ["--version"] or len(args) == 1:
            status, output = _grpo(args if args == ["--version"] else [args[0], "--help"])
            assert status == 0, f"grpo {shlex.join(args)}:\n{output}"
        elif args[0] == "run":
            assert (REPO / "recipes" / f"{args[1]}.py").is_file(), f"no recipe {args[1]}"
            if "--config" not in args:
                return
            config = args[args.index("--config") + 1]
            rest = [arg for arg in args[args.index("--config") + 2 :] if arg != "--verbose"]
            _validate(config, rest, self.folder, self.model)
        elif args[0] == "validate":
            _validate(args[1], args[2:], self.folder, self.model)
        elif args[0] == "cp":
            destination = self.folder / args[2]
            status, output = _grpo(["cp", args[1], str(destination), "--force"])
            assert status == 0 and destination.is_file(), output
        elif args[0] == "plot":
            status, output = _grpo(["plot", "--help"])
            assert status == 0, output
        elif args[0] == "export":  # the checkpoint is a run's: check the flags exist
            status, output = _grpo(["export", "--help"])
            assert status == 0, output
            for flag in (arg for arg in args[1:] if arg.startswith("--")):
                assert flag in output, f"grpo export has no option {flag}"
        elif args[0] == "eval":  # a config: it and its overrides validate; a run folder: none
            status, output = _grpo(["eval", "--help"])
            assert status == 0, output
            rest = [arg for arg in args[1:] if not arg.startswith("--")]
            if "--checkpoint" in args:
                rest.remove(args[args.index("--checkpoint") + 1])
            if not rest[0].startswith(("outputs/", "runs/")):
                _validate(rest[0], rest[1:], self.folder, self.model)
        else:
            raise AssertionError(f"grpo has no command {args[0]!r}")


def _commands(body: str) -> list[list[str]]:
    text = re.sub(r"\\\n\s*", " ", body)  # continued lines
    commands = []
    for line in text.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


# --------------------------------------------------------------------------------------------
# The README
# --------------------------------------------------------------------------------------------


def test_config_reference_matches_the_schema():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "update_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text and "make demo-tools" in text


def test_readme_links_every_docs_page():
    linked = {(README.parent / link.split("#")[0]).resolve() for link in _links(README)}
    missing = [page.name for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_config_is_an_excerpt_of_the_demo_config():
    """Its lines are lines of the config, in the same order (and it validates as a yaml block)."""
    (block,) = [block for block in _blocks(README) if block.lang == "yaml"]
    lines = iter(line.rstrip() for line in BASE_CONFIG.read_text().splitlines())
    for line in block.body.splitlines():
        assert any(line.rstrip() == candidate for candidate in lines), (
            f"README.md:{block.line}: {line!r} is not the next line of {BASE_CONFIG.name}"
        )


def test_readme_figures_are_those_of_the_benchmarks_page():
    """A table row of measured figures in the README is one of docs/benchmarks.md's."""
    benchmarks = (DOCS / "benchmarks.md").read_text().splitlines()
    rows = [line for line in _prose(README).splitlines() if line.startswith("| ")]
    assert rows
    for row in rows:
        if re.search(r"\d", row):
            assert row in benchmarks, f"README.md row not in docs/benchmarks.md: {row}"


def test_a_learning_rate_the_docs_quote_is_the_config_s():
    """``configs/X.yaml` uses `LR``` in a page: X's ``training.optimizer.lr`` is LR."""
    quoted = [
        (page, match)
        for page in PAGES
        for match in re.finditer(r"`(configs/[\w.]+\.yaml)`\s+uses\s+`([^`]+)`", _prose(page))
    ]
    assert quoted
    for page, match in quoted:
        config = yaml.safe_load((REPO / match.group(1)).read_text())
        lr = config["training"]["optimizer"]["lr"]
        assert float(match.group(2)) == float(lr), f"{page.name}: {match.group(0)}, config: {lr}"


def test_configs_point_to_the_config_reference_page():
    """Every shipped config's header names the page that describes every key, which exists."""
    for config in sorted((REPO / "configs").glob("*.yaml")):
        header = "".join(
            line for line in config.read_text().splitlines(keepends=True) if line.startswith("#")
        )
        assert "Every key is described in docs/config.md" in header, config.name
        assert 'README "Config reference"' not in header, config.name
    assert (DOCS / "config.md").read_text().startswith("# Config reference")


# --------------------------------------------------------------------------------------------
# Every page
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_links_resolve(page):
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: link to {link}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{page.name}: link to {link}: no such heading"


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_paths_exist(page):
    for span in _spans(page):
        match = re.fullmatch(
            r"((?:grpo|tests|scripts|configs|assets|docs|recipes)/[\w./-]*)(::\w+)?", span
        )
        if not match:
            continue
        path = REPO / match.group(1)
        assert path.exists(), f"{page.name}: `{span}`: no such file"
        if match.group(2):
            assert f"def {match.group(2)[2:]}(" in path.read_text(), f"{page.name}: `{span}`"


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_dotted_names_import(page):
    for span in _spans(page):
        match = re.fullmatch(r"@?(grpo(?:\.[A-Za-z_]\w*)+)(?:\(\))?", span)
        if match:
            try:
                _resolve(match.group(1))
            except (ImportError, AttributeError) as exc:
                raise AssertionError(f"{page.name}: `{span}` does not import: {exc}") from None


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_overrides_name_config_keys(page):
    from grpo.config import ConfigError, compose_config

    for span in _spans(page):
        try:
            tokens = shlex.split(span)
        except ValueError:
            continue
        override = r"~?[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*=\S.*"
        if span == "key=value":  # the form itself
            continue
        if any(_is_placeholder(token.partition("=")[2]) for token in tokens):
            continue  # a form (`seed=N`), or a line a run prints (`kept=K/S`)
        if tokens and all(re.fullmatch(override, token) for token in tokens):
            try:
                compose_config(BASE_CONFIG, tokens)
            except ConfigError as exc:
                raise AssertionError(f"{page.name}: `{span}`: {exc}") from None


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_commands_in_the_text(page, tmp_path, monkeypatch, stand_in_model):
    monkeypatch.chdir(tmp_path)
    prefixes = ("grpo ", "python scripts/", "python recipes/", "make ", "pip install ")
    shell = Shell(folder=tmp_path, model=stand_in_model)
    for span in _spans(page):
        if span.startswith(prefixes) and "..." not in span:
            shell.check(shlex.split(span))


# --------------------------------------------------------------------------------------------
# Every block
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", _params(_all_blocks("bash")))
def test_shell_block(block, tmp_path, monkeypatch, stand_in_model):
    monkeypatch.chdir(tmp_path)
    shell = Shell(folder=tmp_path, model=stand_in_model)
    for argv in _commands(block.body):
        shell.check(argv)


def _module_name(block: Block) -> str | None:
    match = re.match(r"# (\w+)\.py\n", block.body)
    return match.group(1) if match else None


@pytest.fixture
def doc_modules(tmp_path, monkeypatch):
    """The folder holding every ``# NAME.py`` block of the pages, on the import path."""
    folder = tmp_path / "modules"
    folder.mkdir()
    for block in _all_blocks("python"):
        if name := _module_name(block):
            (folder / f"{name}.py").write_text(block.body)
            sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.mark.parametrize("block", _params(_all_blocks("python")))
def test_python_block(block, doc_modules, tmp_path, monkeypatch):
    """It runs (a module: it imports), and pyflakes finds no undefined name in what does not."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F", "--stdin-filename", "x.py", "-"],
        input=block.body,
        capture_output=True,
        text=True,
    )
    if "No module named ruff" not in result.stderr:
        assert result.returncode == 0, f"{block.id}:\n{result.stdout}{result.stderr}"
    monkeypatch.chdir(tmp_path)
    if name := _module_name(block):
        importlib.import_module(name)
    else:
        exec(compile(block.body, block.id, "exec"), {"__name__": "__doc_snippet__"})


def _lay_over(config: dict, fragment: dict) -> dict:
    for key, value in fragment.items():
        if isinstance(value, dict) and "_component_" not in value:
            config[key] = _lay_over(dict(config.get(key) or {}), value)
        else:
            config[key] = value
    return config


def _stand_in_data(node: dict, folder: Path) -> None:
    """A dataset file the docs name by an example path: written with the columns it names."""
    source = node.get("source") if isinstance(node, dict) else None
    if not (isinstance(source, str) and source.startswith("/") and not Path(source).exists()):
        return
    row = {
        node.get("prompt_key", "question"): "What is 2 + 3?",
        node.get("answer_key", "answer"): "2 + 3 = 5 #### 5 \\boxed{5}",
    }
    path = folder / f"data{Path(source).suffix}"
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([row]), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps([row]))
    else:
        path.write_text(json.dumps(row) + "\n")
    node["source"] = str(path)


def _shipped_configs() -> list[Path]:
    """The demo's config first: a block is laid over each in turn until one passes."""
    others = sorted(path for path in (REPO / "configs").glob("*.yaml") if path != BASE_CONFIG)
    return [BASE_CONFIG, *others]


@pytest.mark.parametrize("block", _params(_all_blocks("yaml")))
def test_yaml_block(block, doc_modules, tmp_path, monkeypatch, stand_in_model):
    """Laid over a shipped config (the demo's, or else one for a real model), it validates."""
    monkeypatch.chdir(tmp_path)
    body = block.body
    for name, stand_in in STAND_INS.items():
        body = body.replace(name, stand_in)
    if "grpo.envs.verifiers_env" in body:
        pytest.importorskip("verifiers")
    fragment = yaml.safe_load(body)
    assert isinstance(fragment, dict), f"{block.id}: not a YAML mapping"
    failures = []
    for base in _shipped_configs():
        folder = tmp_path / f"over_{base.stem}"
        folder.mkdir()
        config = _lay_over(yaml.safe_load(base.read_text()), yaml.safe_load(body))
        for key in ("dataset", "eval_dataset"):
            _stand_in_data(config.get(key), folder)
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        try:
            _validate(str(path), [], folder, stand_in_model)
            return
        except AssertionError as exc:
            failures.append(f"over {base.name}: {exc}")
    raise AssertionError(f"{block.id}: over no shipped config:\n" + "\n".join(failures))
