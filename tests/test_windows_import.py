"""Native Windows: every module of backends, sam3d_objects and patches imports without a Unix-only module.

Run in a fresh subprocess: a meta-path finder makes the Unix-only standard modules (``resource``, ``fcntl``,
``termios``, ``pwd``, ``grp``, ``pty``, ``tty``, ``posix``-only helpers) unavailable to the project's own code
(an import of one from a project module raises ``ModuleNotFoundError``, as on Windows), third-party packages are
imported first with the real platform (torch, numpy... pick their own platform code at import), and then
``sys.platform`` reads ``"win32"`` while every project module is imported. ``/proc`` reads and ``malloc_trim``
are checked by calling the helpers that use them. A module that needs an optional package that is not installed
(open3d, gradio, sam3, ...) is reported, not failed: the check is about the platform, not the extras.
"""
import json
import subprocess
import sys
import textwrap

from conftest import ROOT

PACKAGES = ("backends", "sam3d_objects", "patches")
UNIX_ONLY = ("resource", "fcntl", "termios", "pwd", "grp", "pty", "tty", "posix", "_posixsubprocess",
             "_posixshmem", "syslog", "crypt", "spwd", "nis", "readline", "curses", "_curses")

SCRIPT = textwrap.dedent(r'''
    import importlib, importlib.abc, json, pkgutil, sys, traceback
    sys.path.insert(0, ROOT)
    # third-party packages first, with the real platform
    import numpy, torch  # noqa: F401
    for name in ("scipy", "PIL.Image", "trimesh", "omegaconf", "hydra", "safetensors", "tqdm", "plyfile", "psutil",
                 "triton", "triton.language", "spconv.pytorch", "flash_attn", "xformers.ops", "torchvision"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  absent or broken optional packages: the project's imports will say
            pass

    OURS = tuple(PACKAGES)
    blocked = []

    def importer():
        """The project module whose code runs the import statement (None for anyone else)."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if not name.startswith(("importlib", "_frozen_importlib")) and frame.f_code.co_filename != "<string>":
                return name if name.split(".")[0] in OURS else None
            frame = frame.f_back
        return None

    class UnixOnly(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in UNIX_ONLY:
                who = importer()
                if who is not None:
                    blocked.append((fullname, who))
                    raise ModuleNotFoundError(f"No module named {fullname!r} (Windows)", name=fullname)
            return None

    sys.meta_path.insert(0, UnixOnly())
    # modules already imported (by torch, numpy...) would be served from sys.modules without asking any finder:
    # they are taken out while the project imports (posix stays: os itself is built on it)
    cached = {n: sys.modules.pop(n) for n in list(sys.modules)
              if n.split(".")[0] in UNIX_ONLY and n.split(".")[0] != "posix"}
    real_platform = sys.platform
    sys.platform = "win32"
    names, failures, optional = [], {}, {}
    for package in OURS:
        try:
            pkg = importlib.import_module(package)
        except Exception as e:  # noqa: BLE001  reported below with the modules
            failures[package] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
            continue
        names.append(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + ".", onerror=lambda n: None):
            if info.name.endswith("__main__"):
                continue  # running it is what `python -m` does; its imports are its package's
            names.append(info.name)
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in UNIX_ONLY or (e.name or "").split(".")[0] in OURS:
                failures[name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            else:
                optional[name] = f"needs {e.name}"
        except Exception as e:  # noqa: BLE001  anything else is a real failure to import on Windows
            failures[name] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
    # the helpers that read /proc or call glibc's malloc_trim (or import resource when called) degrade instead of
    # failing; their guarded imports are not module-level ones
    at_import = list(blocked)
    import backends.device as dev
    helpers = {"peak_rss_bytes": dev.peak_rss_bytes(), "current_rss_bytes": dev.current_rss_bytes(),
               "release_host_memory": dev.release_host_memory(),
               "keep_freed_host_memory": dev.keep_freed_host_memory()}
    sys.platform = real_platform
    sys.modules.update(cached)
    print("RESULT " + json.dumps({"modules": len(names), "failures": failures, "optional": optional,
                                  "blocked": at_import, "helpers": helpers}))
''')


def run_script():
    code = (f"ROOT = {str(ROOT)!r}\nPACKAGES = {PACKAGES!r}\nUNIX_ONLY = {UNIX_ONLY!r}\n" + SCRIPT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_every_module_imports_without_unix_only_modules():
    result = run_script()
    assert result["modules"] > 100  # every module was walked, not just the packages
    assert not result["failures"], json.dumps(result["failures"], indent=1)
    assert not result["blocked"], result["blocked"]  # no project module even tried a Unix-only import
    helpers = result["helpers"]
    assert helpers["peak_rss_bytes"] >= 0 and helpers["current_rss_bytes"] >= 0
    assert isinstance(helpers["release_host_memory"], bool)
    assert isinstance(helpers["keep_freed_host_memory"], bool)


def test_the_blocker_catches_a_module_level_unix_import(tmp_path):
    """The check can fail: a project-like module importing ``resource`` at module level is reported."""
    pkg = tmp_path / "sam3d_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "unixy.py").write_text("import resource\n")
    script = SCRIPT.replace("import backends.device as dev", "sys.path.insert(0, {!r}); import backends.device as dev"
                            .format(str(ROOT)))
    code = (f"ROOT = {str(tmp_path)!r}\nPACKAGES = ('sam3d_probe_pkg',)\nUNIX_ONLY = {UNIX_ONLY!r}\n" + script)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert "sam3d_probe_pkg.unixy" in result["failures"]
    assert result["blocked"] == [["resource", "sam3d_probe_pkg.unixy"]]
