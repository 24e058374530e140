"""Make the tests' own helpers (tests/exhaustive.py) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
