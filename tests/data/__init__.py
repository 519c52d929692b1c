import os
from pathlib import Path

# Files written by Megatron-DeepSpeed's own data code. The repository sits next to shared/
# (../shared/fixtures/megatron); BLOOMTRAIN_FIXTURES points elsewhere.
FIXTURES = Path(os.environ.get("BLOOMTRAIN_FIXTURES")
                or Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "megatron")
if not (FIXTURES / "cases.json").is_file():
    raise RuntimeError(f"Megatron fixtures not found at {FIXTURES}: check out shared/ next to the "
                       f"repository or set BLOOMTRAIN_FIXTURES")
