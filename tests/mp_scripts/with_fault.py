"""Run a module with fault points armed: `with_fault.py --kill-at NAME:key=INT [...] -m MODULE ARGS...`.

Each --kill-at SIGKILLs the process when the module reaches that named point
(`megatron_trace.faults`), each --raise-at raises `faults.InjectedFault` there; the arming happens
here, in the process that will die or fail, so no test needs a clock to decide when.
"""

import argparse
import runpy
import sys

from megatron_trace import faults

ap = argparse.ArgumentParser()
ap.add_argument("--kill-at", action="append", default=[], metavar="NAME:key=INT")
ap.add_argument("--raise-at", action="append", default=[], metavar="NAME:key=INT")
ap.add_argument("-m", dest="module", required=True)
args, rest = ap.parse_known_args()
for specs, action in ((args.kill_at, faults.kill_self), (args.raise_at, faults.raise_error)):
    for spec in specs:
        name, where = faults.parse_spec(spec)
        faults.arm(name, action, **where)
sys.argv = [args.module, *rest]
runpy.run_module(args.module, run_name="__main__", alter_sys=True)
