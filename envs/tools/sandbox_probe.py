"""The probe envs/tools/sandbox_root.py runs, by path, as each interpreter the sandbox may use (on the host, once
per interpreter: `python -I -S -B sandbox_probe.py`; the standard library only): imports every extension module of
its lib-dynload so their shared libraries are loaded, then prints, as one JSON line, its paths and the files
mapped into it.
"""

import importlib
import json
import os
import sys
import sysconfig


def main() -> None:
    paths = sysconfig.get_paths()
    dyn = set()
    for d in {paths["stdlib"], paths["platstdlib"]}:
        dyn.add(os.path.join(d, "lib-dynload"))
    for m in ("_json", "math", "_socket", "select"):
        try:
            f = getattr(importlib.import_module(m), "__file__", None)
            if f:
                dyn.add(os.path.dirname(f))
        except ImportError:
            pass
    for d in dyn:
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if name.endswith(".so"):
                try:
                    importlib.import_module(name.split(".")[0])
                except BaseException:
                    pass
    maps = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                maps.add(parts[5].strip())
    print(json.dumps({"executable": os.path.realpath(sys.executable), "stdlib": [paths["stdlib"], paths["platstdlib"]],
                      "dynload": sorted(dyn), "maps": sorted(maps)}))


if __name__ == "__main__":
    main()
