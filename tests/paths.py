"""Where the tests find the repository's files, from whichever folder of tests/ they run."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: the helper modules, fixtures/, golden/
ROOT = TESTS.parent  # the repository: cli.py, examples/
FIXTURES = TESTS / "fixtures"
EXAMPLE = ROOT / "examples" / "example-L24.chain.json"
