"""Where the tests find the repository's files, from whichever folder of tests/ they run."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: the helper modules, fixtures/, golden/
ROOT = TESTS.parent  # the repository: cli.py, examples/
FIXTURES = TESTS / "fixtures"
EXAMPLE = ROOT / "examples" / "example-L24.chain.json"


def load_module(path: Path, name: str):
    """The Python file ``path`` loaded as a module named ``name`` (a fixture, a bench script: no package)."""
    loaded = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def load_fixture(name: str):
    """The module tests/fixtures/NAME.py."""
    return load_module(FIXTURES / f"{name}.py", f"fixture_{name}")
