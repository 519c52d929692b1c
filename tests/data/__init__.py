import os
from pathlib import Path

# Files written by Megatron-DeepSpeed's own data code (tests/fixtures/megatron, with their README),
# kept in the repository so that a fresh clone tests itself; BLOOMTRAIN_FIXTURES points elsewhere.
FIXTURES = Path(os.environ.get("BLOOMTRAIN_FIXTURES")
                or Path(__file__).resolve().parents[1] / "fixtures" / "megatron")
if not (FIXTURES / "cases.json").is_file():
    raise RuntimeError(f"Megatron fixtures not found at {FIXTURES}: tests/fixtures/megatron is "
                       f"part of the repository; restore it (git checkout tests/fixtures) or point "
                       f"BLOOMTRAIN_FIXTURES at a copy")
