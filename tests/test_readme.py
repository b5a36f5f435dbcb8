"""The README and the docs say what is true and runnable: every Python block runs as is in a fresh interpreter (a
docs block that needs the hub or a GPU says so in its first line and is skipped), every shell command names the
virtual environment and its trainer commands parse, every "tested" names a test that exists, the README stays a
landing page (a length bound, a map of every docs page), its figures come from the files that measured them, and
.ci/run runs the README's test command."""

import ast
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_MAX_LINES = 200  # a newcomer reads it in five minutes; the rest belongs in docs/
# Every page a reader is sent to: the README, the docs site, the benchmarks' own README
PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
}
# A docs block that cannot run here says why in its first line, e.g. "# needs the hub" or "# needs a GPU"
NEEDS = re.compile(r"#.*\bneeds\b.*\b(hub|GPU)\b")


def fenced_blocks(text: str, language: str) -> list[tuple[str, int, int, str]]:
    """(the heading it is under, start, end, the code) of every ```language block of a page."""
    blocks = []
    for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        headings = re.findall(r"^#{1,3} (.+)$", text[: match.start()], re.MULTILINE)
        blocks.append((headings[-1] if headings else "", match.start(), match.end(), match.group(1)))
    return blocks


def python_blocks() -> list[tuple[str, str, str]]:
    """(page, heading, code) of every ```python block of every page."""
    return [
        (page, heading, code) for page, text in PAGES.items() for heading, _, _, code in fenced_blocks(text, "python")
    ]


BLOCKS = python_blocks()


@pytest.mark.parametrize(
    "page, heading, code", BLOCKS, ids=[f"{p}-{i}-{h.split(':')[0][:30]}" for i, (p, h, _) in enumerate(BLOCKS)]
)
def test_every_python_block_runs_as_is_in_a_fresh_interpreter(page, heading, code, tmp_path):
    first = code.splitlines()[0]
    if page != "README.md" and NEEDS.match(first):
        pytest.skip(f"{page} '{heading}': {first.lstrip('# ')}")
    # offline, from an empty folder, with nothing imported beforehand: only what the block itself says
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{page} block in '{heading}' failed:\n{proc.stderr[-3000:]}"
    if "print(" in code:
        assert proc.stdout.strip(), "the block prints nothing"


def test_the_readme_is_a_landing_page_with_the_blocks_a_newcomer_copies():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )
    headings = re.findall(r"^## (.+)$", README, re.MULTILINE)
    order = ["Where it stands", "The two commands", "`grpo_loss`", "Drop-in for TRL", "Other trainers", "Benchmarks"]
    assert [h for h in headings if any(h.startswith(o) for o in order)] == [
        next(h for h in headings if h.startswith(o)) for o in order
    ], headings
    blocks = {heading: code for page, heading, code in BLOCKS if page == "README.md"}
    assert "grpo_loss(" in blocks["`grpo_loss`"]
    assert "FusedGRPOTrainer" in blocks["Drop-in for TRL"] and "trainer.train()" in blocks["Drop-in for TRL"]
    # where the results stand comes before any speed figure
    assert README.index("## Where it stands") < README.index("× ours time")
    assert "not measured" in README[: README.index("## The two commands")]


def test_the_demo_figures_are_written_from_the_demo_summary():
    spec = importlib.util.spec_from_file_location("update_demo_figures", ROOT / "scripts" / "update_demo_figures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    summary = json.loads((ROOT / "docs" / "demo" / "summary.json").read_text())
    quoted = re.search(re.escape(script.BEGIN) + "(.*?)" + re.escape(script.END), README, re.DOTALL).group(1)
    assert quoted == script.figures(summary)
    assert f"{summary['after']['accuracy']:.1%}" in quoted
    assert (ROOT / summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ci_runs_the_readme_test_command_which_builds_the_docs():
    commands = re.search(r"## The two commands.*?```bash\n(.*?)```", README, re.DOTALL).group(1)
    test_command = next(line for line in commands.splitlines() if "pytest" in line).strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
    mkdocs = next(shlex.split(part) for part in test_command.split("&&") if "mkdocs" in part)
    # --strict fails on a broken link or a page missing from the nav; -q/--quiet would hide those warnings, and
    # mkdocs 1.6 then exits 0 whatever they say
    assert mkdocs[:3] == [".venv/bin/mkdocs", "build", "--strict"] and not {"-q", "--quiet"} & set(mkdocs), mkdocs


def test_the_benchmark_table_is_the_results_files():
    """Each row of the README's CPU table is a row of the results file it names, figure for figure, and no measured
    row of that file is left out."""
    section = README[README.index("## Benchmarks") :]
    source = re.search(r"`(benchmarks/results/cpu-[^`]+\.md)`", section).group(1)
    results = (ROOT / source).read_text()

    def rows(text: str) -> list[list[str]]:
        return [
            [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if re.match(r"\| \d", line)
        ]

    # the results table: V, B·T, contender, median, [p20, p80], CPU time, first call, peak, GB/s, % copy, × time, × mem
    measured = {tuple(r[i] for i in (0, 1, 2, 3, 6, 7, 10, 11)) for r in rows(results) if r[3] != "–"}
    quoted = [tuple(r) for r in rows(section)]
    assert quoted and all(len(r) == 8 for r in quoted), quoted
    assert set(quoted) <= measured, set(quoted) - measured
    assert len(set(quoted)) == len(measured), measured - set(quoted)


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_docs_page_is_in_the_site_and_the_readme_map():
    """The site's nav holds every page of docs/, and the README's map (its last table) links each of them once, so
    that a page is neither unreachable from the README nor listed without existing."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = [p for p in _nav_pages(config["nav"]) if p != "index.md"]
    assert len(nav) == len(set(nav)), nav
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert on_disk <= set(nav), on_disk - set(nav)  # (a nav page that does not exist fails `mkdocs build --strict`)
    docs_map = README[README.index("## Documentation") :]
    linked = re.findall(r"^\| \[[^\]]+\]\(docs/([\w.]+)\)", docs_map, re.MULTILINE)
    assert sorted(linked) == sorted(nav), (linked, nav)
    site_map = re.findall(r"^\| \[[^\]]+\]\(([\w.]+)\)", (ROOT / "docs" / "index.md").read_text(), re.MULTILINE)
    assert sorted(site_map) == sorted(nav), (site_map, nav)


def _links(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", target)]


def _anchors(markdown: str) -> set[str]:
    """The ids mkdocs' default toc gives each heading: lower case, punctuation dropped, spaces to hyphens."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE), re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", slug))
    return ids


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_links_of_the_pages_outside_the_site_resolve(page):
    """mkdocs checks the links of docs/; the README and the benchmarks' README are outside it, so their links (to a
    file, and to a heading in a markdown file) are checked here."""
    base = (ROOT / page).parent
    for target in _links(PAGES[page]):
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else ROOT / page
        assert file.exists(), f"{page}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file.read_text()), f"{page}: link to {target}: no such heading"


TEST_REF = re.compile(r"tests/[\w/]+\.py(?:::\w+)+")


def _sentences(text: str) -> list[str]:
    """The sentences of a page's prose (code blocks dropped): split at a full stop followed by a capital, outside
    parentheses and code spans, so that "(tested: `tests/a.py::b`)" stays with its claim."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    out = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*[-|] )|\n(?=\s*\d+\. )", prose):
        flat, depth, code, start = " ".join(paragraph.split()), 0, False, 0
        for i, ch in enumerate(flat):
            code = not code if ch == "`" else code
            depth += (ch == "(") - (ch == ")") if not code else 0
            if ch == "." and not code and depth <= 0 and re.match(r"\s+[A-Z*`]", flat[i + 1 : i + 3]):
                out.append(flat[start : i + 1])
                start = i + 1
        out.append(flat[start:])
    return [s.strip() for s in out if s.strip()]


def _test_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
    return names


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_tested_claim_names_a_test_that_exists(page):
    """Each sentence that says "tested" names the test that holds it (`tests/<file>.py::<test>`), and every test so
    named, and every `tests/...` file a page names, exists."""
    unnamed = [s for s in _sentences(PAGES[page]) if re.search(r"\btested\b", s, re.I) and not TEST_REF.search(s)]
    assert not unnamed, f"{page}: 'tested' without the test's name:\n" + "\n".join(unnamed)
    for ref in TEST_REF.findall(PAGES[page]):
        file, *names = ref.split("::")
        assert (ROOT / file).is_file(), f"{page}: {ref}: no such file"
        missing = set(names) - _test_names(ROOT / file)
        assert not missing, f"{page}: {ref}: no test named {missing} in {file}"
    for file in re.findall(r"`(tests/[\w/.]+\.py)`", PAGES[page]):
        assert (ROOT / file).is_file(), f"{page}: {file}: no such file"


def bash_blocks() -> list[tuple[str, str, str, str]]:
    """(page, heading, the paragraph before it, the commands) of every ```bash block, continuation lines joined and
    comments dropped."""
    blocks = []
    for page, text in PAGES.items():
        end = 0
        for heading, start, stop, code in fenced_blocks(text, "bash"):
            before = text[end:start].strip().rsplit("\n\n", 1)[-1]
            joined = re.sub(r"\\\n\s*", " ", code)
            lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
            blocks.append((page, heading, before, "\n".join(c for c in lines if c and not c.startswith("#"))))
            end = stop
    return blocks


BASH = bash_blocks()
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def commands(code: str) -> list[list[str]]:
    """Each command of a block (split at &&) as its words, its environment (assignments, `env -u NAME`) dropped."""
    out = []
    for line in code.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part)
            if words[:1] == ["env"]:
                words = words[1:]
                while words[:1] == ["-u"]:
                    words = words[2:]
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            out.append(words)
    return out


def _is_checkout_install(words: list[str]) -> bool:
    """`pip install -e .` / `-e '.[extra,...]'` with extras of pyproject.toml: the package is on no index."""
    targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-") and "==" not in w]
    if not targets or "-e" not in words:
        return False
    return all(
        re.fullmatch(r"\.(\[[\w,-]+\])?", t) and set(re.findall(r"[\w-]+", t.strip(".[]"))) <= EXTRAS for t in targets
    )


def test_every_command_runs_from_the_checkout_with_the_venv_named():
    """A shell has no `grpo-kernels`, `torchrun` or the venv's `python` until the venv is activated: every command
    names it (or is the one that makes it, or runs a script of the checkout, which picks its interpreter), and every
    install is of this checkout (`-e .` or `-e '.[extra]'`, the extra one of pyproject.toml's), never of an index
    (pip's own upgrade aside)."""
    assert len(BASH) >= 6  # the setup, the trainer, reasoning-gym, the launchers, explore, the GPU check: not vacuous
    for page, heading, _, code in BASH:
        for words in commands(code):
            program = words[0]
            script = program == "bash" and (ROOT / words[1]).is_file()
            assert program.startswith(".venv/bin/") or words[:3] == ["python3", "-m", "venv"] or script, (page, words)
            if program.endswith("/pip") and "install" in words and words[-1] != "pip":  # pip itself: -U pip
                assert _is_checkout_install(words), (page, heading, words)


def trainer_commands() -> list[tuple[str, str, list[str]]]:
    """(page, the paragraph before, the arguments after `train`) of every `grpo-kernels train` in a block."""
    found = []
    for page, _, before, code in BASH:
        for words in commands(code):
            if "train" in words and any(w.endswith("grpo-kernels") or w == "grpo_kernels.cli" for w in words):
                found.append((page, before, words[words.index("train") + 1 :]))
    return found


def test_every_trainer_command_parses_and_says_what_it_needs():
    """The flags and values of every `grpo-kernels train` command exist and are valid (a renamed flag fails here),
    and a command that needs what a checkout lacks (the hub for a model, a data file of your own, a GPU) says so in
    the paragraph before its block."""
    from grpo_kernels.cli import build_parser
    from grpo_kernels.trainer.config import TrainConfig

    found = trainer_commands()
    assert len(found) >= 4  # the trainer, reasoning-gym, the two launchers: not vacuous
    for page, before, argv in found:
        args = build_parser().parse_args(["train", *argv])
        cfg = TrainConfig.from_flat({k: v for k, v in vars(args).items() if k != "command"})
        suite = cfg.dataset.startswith("reasoning-gym:")
        local = (ROOT / cfg.model).is_dir() and (suite or (ROOT / cfg.dataset).exists())
        if not local:
            assert "needs" in before, (page, argv, before)
            if not (ROOT / cfg.model).is_dir():
                assert "hub" in before, (page, argv, before)


# Pages whose inline commands do not follow the rules yet, and why (the page's owner fixes them)
INLINE_EXCEPTIONS: dict[str, str] = {}


@pytest.mark.parametrize("page", sorted(set(PAGES) - set(INLINE_EXCEPTIONS)))
def test_inline_commands_name_the_venv_and_installs_are_of_the_checkout(page):
    """Commands quoted in the prose follow the blocks' rules: a `pip install` is an editable install of this checkout
    through the venv (the package is on no index), and no command starts with a bare `python`, `pip`, `pytest`,
    `grpo-kernels`, `torchrun` or `accelerate`."""
    prose = re.sub(r"^```.*?^```", "", PAGES[page], flags=re.DOTALL | re.MULTILINE)
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)
    installs = [code for code in spans if re.search(r"pip install \S", code)]
    assert all(code.startswith(".venv/bin/pip install -e ") for code in installs), installs
    # a command (the program and an argument that is a flag, file or path), not the program's name in a sentence
    bare = [
        code for code in spans if re.match(r"(python3?|pip|pytest|grpo-kernels|torchrun|accelerate)( \S*[-./])", code)
    ]
    assert not bare, bare
