"""Import contracts (DESIGN.md §1, issue #18): the packages' rules live in .importlinter and run
through import-linter; app.py, a module rather than a package, is checked here by its AST."""
import ast
import configparser
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
APP_ALLOWED = {"gradio", "chat"}  # besides the standard library


def imported_roots(path: Path) -> set[str]:
    """Top-level package names a module imports, anywhere in it (functions included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def lint(directory: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=directory, capture_output=True,
                          text=True, timeout=300)


def test_app_imports_only_gradio_chat_and_the_standard_library():
    roots = imported_roots(ROOT / "app.py")
    assert roots - APP_ALLOWED - set(sys.stdlib_module_names) == set()


def test_the_import_contracts_hold():
    result = lint(ROOT, ROOT / ".importlinter")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in result.stdout


def test_a_broken_contract_fails_the_check(tmp_path):
    """The same contracts over a tree of empty packages in which chat/ reaches into the engine."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    for package in parser["importlinter"]["root_packages"].split():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for name in ("config", "errors", "attention"):
        (tmp_path / "spotlight" / f"{name}.py").write_text("")
    (tmp_path / "chat" / "turns.py").write_text("from spotlight import config\nfrom spotlight.attention import x\n")
    result = lint(tmp_path, ROOT / ".importlinter")
    assert result.returncode == 1
    assert "chat.turns -> spotlight.attention (l.2)" in result.stdout
