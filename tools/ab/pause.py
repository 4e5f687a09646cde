"""What the GPU's power cap costs a synchronised call: the layer's call timed as the bench times it
(the host clock around the call and block_until_ready), with the GPU left idle for PAUSE ms
before each call, for each pause asked, with the SM clock and power draw meanwhile and the GPU's
joules a call (NVML's counter; pauses included, so only rows without pauses compare). A call that
meets the 700 W cap runs at a lower clock; a pause lets the power average fall first, so the
difference between pauses is the part of a call's time that its energy costs under the cap.
Each pause starts after a second of calls without pauses, so that every row starts from the
same state. Usage: python tools/ab/pause.py SHAPE [MODE] [PAUSES_MS] (default 0,5,20,50)."""

import sys
import time

import jax

from measure import joules, mode_call
from mok_jax.bench import clocks
from mok_jax.bench import timing

CALLS = 30
HEAT_S = 1.0


def heat(call, heat_s=HEAT_S):
  """Calls without pauses for `heat_s` seconds: every row starts at the power average they
  leave."""
  start = time.perf_counter()
  while time.perf_counter() - start < heat_s:
    jax.block_until_ready(call())


def timed_calls(call, pause_ms, calls=CALLS):
  """Seconds of each of `calls` synchronised calls, each timed as the bench times one
  (timing.wall_clock) after `pause_ms` of sleep on the host."""
  run_once = timing.wall_clock(lambda i: call(), jax.block_until_ready)
  seconds = []
  for i in range(calls):
    time.sleep(pause_ms / 1e3)
    seconds.append(run_once(i))
  return seconds


def main(argv):
  shape = argv[0]
  mode = argv[1] if len(argv) > 1 else "fwd+bwd"
  pauses = [float(p) for p in (argv[2] if len(argv) > 2 else "0,5,20,50").split(",")]
  f, args = mode_call(shape, mode)
  jax.block_until_ready(f(*args))
  for pause in pauses:
    heat(lambda: f(*args))
    gpu = {}
    with clocks.sampling(gpu, "calls"):
      seconds = timed_calls(lambda: f(*args), pause)
    ms = timing.summarize(seconds)
    row = gpu.get("calls")
    clock = (f" at {row['sm_mhz']:.0f} MHz ({row['sm_mhz_min']:.0f}-{row['sm_mhz_max']:.0f}), "
             f"{row['power_w']:.0f} W" if row else "")
    print(f"{shape} {mode} pause {pause:g} ms: {ms['median']:.3f} ms a call "
          f"(p25-p75 {ms['p25']:.3f}-{ms['p75']:.3f}){clock}"
          f"{joules(row, {'timed_calls': len(seconds)})}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
