"""Where the tests find the repository's files, from whichever folder of tests/ they run."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: the helper modules, fixtures/, golden/
ROOT = TESTS.parent  # the repository: cli.py, examples/
FIXTURES = TESTS / "fixtures"
EXAMPLE = ROOT / "examples" / "example-L24.chain.json"


def load_fixture(name: str):
    """The module tests/fixtures/NAME.py."""
    loaded = importlib.util.spec_from_file_location(f"fixture_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module
