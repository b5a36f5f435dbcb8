"""What the sample may read: the system's folders and its interpreter's standard library, never an installed package
unless named, nor anything under /usr/local but the interpreter itself.

The caller computes a `View` once per interpreter and set of packages (`view_of`); the sandboxed launcher applies it
twice over: Landlock read rules for `read` (a folder that holds a hidden one is replaced by its other children), and,
in its mount namespace, an empty read-only tmpfs over each `hide`, with each `show` bound back read-only inside it
(`launcher.apply_view`).
"""

from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass

SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc")
_PACKAGE_FOLDERS = ("site-packages", "dist-packages", "lib*/python3*/site-packages", "lib*/python3*/dist-packages")


@dataclass(frozen=True)
class View:
    read: list[str]  # the paths the sample may read (Landlock rules), none of them holding a hidden path
    roots: list[str]  # the same, coarse: enough where the mount namespace covers every hidden folder
    hide: list[str]  # folders covered by an empty tmpfs in the mount namespace
    show: list[str]  # paths inside a hidden folder bound back, read only: the interpreter, the named packages
    path: list[str]  # the folders of the named packages, appended to the sample's sys.path


_PROBE = (
    "import sys, json, os\n"
    "libs = {line.split()[-1] for line in open('/proc/self/maps') if '/libpython' in line}\n"
    "files = [os.path.realpath(sys.executable), *sorted(map(os.path.realpath, libs))]\n"
    "print(json.dumps([sys.path, sys.base_prefix, sys.base_exec_prefix, sys.version, files]))"
)


def interpreter(python: str) -> dict:
    """The folders `python -I -S` imports from (its standard library) and its prefixes, where its own package
    folders are, and the files that run it: its executable and its libpython, if it has one (asked of it: it may
    not be ours)."""
    out = subprocess.run(
        [python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True, env={}
    )  # fmt: skip
    path, prefix, exec_prefix, version, files = json.loads(out.stdout)
    return {"path": path, "prefixes": [prefix, exec_prefix], "version": version, "files": files}


def view_of(python: dict, packages: dict[str, list[str]], private_home: bool, also_hide: list[str]) -> View:
    """The view for an interpreter (`interpreter`) and packages ({sys.path folder: [its entries to show]}).
    `private_home`: the sample runs under another uid, so a folder others may not traverse (/root, a home) on the
    way to the interpreter is covered as well, and the interpreter bound back inside it. `also_hide`: the caller's
    own package folders, covered even where no root holds them (for a machine without Landlock)."""
    stdlib = [os.path.realpath(p) for p in python["path"] if os.path.exists(p)]
    # the interpreter's standard library, not its prefix: that may be /usr/local itself (the python images)
    roots = _unique([*(os.path.realpath(p) for p in SYSTEM if os.path.exists(p)), *stdlib])
    hidden = {"/usr/local"}
    for folder in (*roots, *python["prefixes"]):
        for pattern in _PACKAGE_FOLDERS:
            hidden.update(os.path.realpath(p) for p in glob.glob(os.path.join(folder, pattern)))
    hidden.update(os.path.realpath(site) for site in [*packages, *also_hide] if os.path.isdir(site))
    if private_home:
        hidden.update(p for p in map(_closed_ancestor, roots) if p)
    entries = [os.path.realpath(os.path.join(site, e)) for site, names in packages.items() for e in names]
    entries += python.get("files", [])  # the sample may start its interpreter again (`sys.executable`)
    # a hidden folder around a root (a private home) is the mount namespace's business, not Landlock's
    read = [p for r in roots for p in _readable(r, {h for h in hidden if not _inside(r, h)})] + entries
    # a standard library under /usr/local or a private home is bound back, its own package folders hidden again
    shown = [p for p in _unique([*roots, *entries]) if any(_inside(p, h) for h in hidden)]
    show = [p for p in shown if not any(p != s and _inside(p, s) and _covers(s, p, hidden) for s in shown)]
    # a hidden folder inside another needs its own tmpfs only where something shown lies between them
    hide = sorted(h for h in hidden if os.path.isdir(h) and not _covered(h, hidden - {h}, show))
    return View(_unique(read), _unique([*roots, *entries]), hide, show, _unique(packages))


def _covers(outer: str, inner: str, hidden: set[str]) -> bool:
    """Binding `outer` back already shows `inner`: no hidden folder lies between them."""
    return not any(_inside(h, outer) and h != outer and _inside(inner, h) for h in hidden)


def _readable(root: str, hidden: set[str], seen: set[str] | None = None) -> list[str]:
    """`root`, or where a hidden folder lies inside it, its other children (recursively): Landlock rules can only
    allow, so an allowed folder must hold nothing hidden."""
    if not any(_inside(h, root) and h != root for h in hidden):
        return [root]
    seen = set() if seen is None else seen
    if root in seen:  # a link back up
        return []
    seen.add(root)
    out = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    for name in names:
        child = os.path.join(root, name)
        target = os.path.realpath(child)
        if child in hidden or any(_inside(target, h) for h in hidden):
            continue
        out += _readable(target, hidden, seen)  # for a link, where it leads: that may hold a hidden folder too
    return out


def _closed_ancestor(path: str) -> str | None:
    """The outermost folder on the way to `path` that a user with no relation to its owner may not traverse."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        folder = os.sep.join(parts[:i])
        if os.path.isdir(folder) and not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def _covered(path: str, hidden: set[str], show: list[str]) -> bool:
    """A tmpfs over an outer hidden folder already hides `path`, with nothing shown in between."""
    return any(_inside(path, h) and not any(_inside(s, h) and _inside(path, s) for s in show) for h in hidden)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _unique(paths) -> list[str]:
    return list(dict.fromkeys(paths))


# Folders the sample gets empty ones of its own in place of (launcher.fresh_folder, launcher.hide_shared_folders):
# nothing installed there can be shown to it.
SAMPLE_OWN = ("/tmp", "/run", "/dev/shm", "/var/tmp")


def installed(names: tuple[str, ...], stdlib: list[str]) -> dict[str, list[str]]:
    """{sys.path folder: [entries]} of what `names` (top-level modules) need from their installed distributions:
    the package itself and what its wheel put beside it (numpy.libs, the .dist-info). A module of the standard
    library (found in a folder of `stdlib`, the interpreter's own sys.path) needs nothing. `ValueError` naming
    `packages` for one that is not installed."""
    import importlib.metadata
    import importlib.util

    found: dict[str, list[str]] = {}
    owners = importlib.metadata.packages_distributions() if names else {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ValueError(f"packages: {name!r} is not installed for {sys.executable}")
        if spec.origin in (None, "built-in", "frozen") and not spec.submodule_search_locations:
            continue
        places = [os.path.realpath(p) for p in spec.submodule_search_locations or [spec.origin]]
        if all(os.path.dirname(p) in map(os.path.realpath, stdlib) for p in places):
            continue
        for place in places:
            own = [f for f in SAMPLE_OWN if _inside(place, f)]
            if own:
                raise ValueError(
                    f"packages: {name!r} is installed under {own[0]} ({place}), which the sample sees as an empty "
                    "folder of its own: install it (the virtual environment) elsewhere to show it"
                )
        for place in places:
            site, entry = os.path.split(place)
            entries = found.setdefault(site, [])
            entries.append(entry)
            for dist in owners.get(name, []):
                for file in importlib.metadata.distribution(dist).files or []:
                    top = file.parts[0]
                    if top != ".." and os.path.exists(os.path.join(site, top)) and top not in entries:
                        entries.append(top)
    return found
