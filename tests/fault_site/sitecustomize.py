"""Run by every interpreter whose PYTHONPATH names this folder (tests/faults.py's env()): the
faults its environment asks for."""
from tests import faults

faults.install()
