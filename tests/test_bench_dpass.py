"""bench.dpass_backward on 4 simulated CPU devices: the shard_map form of the shared d-pass's
batched backward computes the GSPMD step's g, d and BatchNorm statistics without gathering."""

from cpu_devices import run_on_cpu_devices

_SCRIPT = """
import json
from bench import dpass_backward
rows = dpass_backward.measure("resnet_tiny", 4, per_device_batch=2, steps=1)
print(json.dumps(rows))
"""


def test_local_backward_matches_and_does_not_gather():
  rows = {row["backward"]: row for row in run_on_cpu_devices(_SCRIPT)}
  assert "all-gather" in rows["batched"]["collectives"]  # why the loop avoids it on 4 devices
  assert set(rows["local"]["collectives"]) == {"all-reduce"}
  for row in rows.values():
    # float32 sums over the batch and the devices in another order: rounding of a few ulps of
    # the largest entry (~1e-7 relative), far below a wrong scale (1/N or 1/sqrt(N): >= 0.3).
    assert row["g"] < 1e-5 and row["d"] < 1e-5 and row["rest"] < 1e-5, row
