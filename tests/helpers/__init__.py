"""What several test files share: probes of the work a forward does, input batches, checkpoints.
Importable as `helpers` because pytest puts tests/ on sys.path (pyproject: pythonpath)."""

from pathlib import Path

# The repository root, wherever a test file sits below tests/.
ROOT = Path(__file__).resolve().parents[2]
