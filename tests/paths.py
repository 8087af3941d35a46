"""Where the checkout's parts are, for tests in any folder under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
DEPLOY = ROOT / "deploy"
