"""Is this machine ready for a model? `python -m colibri.doctor [MODEL]
[--threads N] [--json]` prints what `colibri doctor` prints: the CPU and the
kernel level Colibri runs, cores and a thread count, memory, huge pages,
the mlock limit, NUMA nodes, the environment variables that change kernels,
and for a model (a directory or a GGUF file, read without loading its
weights) its experts' size against free memory and the kernels each expert
shape takes; each problem found with the command that fixes it.
`report(model, threads)` returns the same as a dict (colibri_doctor's JSON).
"""

import argparse
import ctypes
import json
import os
import sys

from . import _lib as L


def report(model=None, threads=0):
    """colibri_doctor's report as a dict (sections as in the module docstring;
    "problems" a list of {"problem", "fix"}). Raises ColibriError naming a
    model that cannot be read."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError("threads must be an int >= 0 (0 = one per core), got %r" % (threads,))
    out = ctypes.c_void_p()
    size = ctypes.c_size_t()
    path = os.fsencode(os.fspath(model)) if model is not None else None
    L.check(L.fn("colibri_doctor")(path, threads, ctypes.byref(out), ctypes.byref(size)), "colibri_doctor")
    try:
        text = ctypes.string_at(out.value, size.value).decode("utf-8", "replace")
    finally:
        L.lib().colibri_buffer_free(out)
    return json.loads(text)


def format_report(r):
    """The report as the CLI prints it: a line per section, the model's
    kernels a line per expert shape, then the problems and their fixes."""
    def value(v):
        return v if isinstance(v, str) else json.dumps(v)

    lines = []
    for section, fields in r.items():
        if section == "problems" or not isinstance(fields, dict):
            continue
        lines.append("%-12s %s" % (section, ", ".join("%s %s" % (k, value(v)) for k, v in fields.items()
                                                      if k != "kernels")))
        for k in fields.get("kernels", []):
            lines.append("%-12s %s: %s%s" % ("kernels", k["types"], k["registry"],
                                             "" if k["measured"] is None
                                             else "; measured at an earlier open: " + k["measured"]))
    if not r["problems"]:
        lines.append("problems     none found")
    for p in r["problems"]:
        lines.append("problem      %s\n  fix        %s" % (p["problem"], p["fix"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m colibri.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="model directory or GGUF file (read, not loaded)")
    ap.add_argument("--threads", type=int, default=0, help="threads the model would run on (0 = one per core)")
    ap.add_argument("--json", action="store_true", help="print the JSON document")
    a = ap.parse_args(argv)
    try:
        r = report(a.model, a.threads)
    except (L.ColibriError, ValueError) as e:
        print("colibri doctor: %s" % e, file=sys.stderr)
        return 1
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
