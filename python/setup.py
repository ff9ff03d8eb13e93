"""Build hook of the colibri package (metadata is in pyproject.toml).

Set COLIBRI_BUNDLE_LIBRARY to a built libcolibri.so (or to a build folder
holding one) to copy it into the installed package, where colibri looks
first after $COLIBRI_LIBRARY; the wheel is then marked platform-specific.
Without it the package is pure Python and finds the library at run time
($COLIBRI_LIBRARY, the source tree's build*/ folders, or the system's).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


def bundled_library():
    src = os.environ.get("COLIBRI_BUNDLE_LIBRARY")
    if not src:
        return None
    # pip runs this from a copy or from python/, not from the caller's
    # folder: a relative path is tried as given, then from the repository
    # root (python/..).
    here = os.path.dirname(os.path.abspath(__file__))
    tried = []
    for base in ("", os.path.dirname(here)):
        cand = os.path.join(base, src) if base else src
        if os.path.isdir(cand):
            cand = os.path.join(cand, "libcolibri.so")
        tried.append(os.path.abspath(cand))
        if os.path.isfile(cand):
            src = os.path.realpath(cand)  # the versioned file behind the symlinks
            break
        if os.path.isabs(src):
            break
    else:
        src = None
    if src is None or not os.path.isfile(src):
        raise SystemExit("COLIBRI_BUNDLE_LIBRARY: no library at %s (build it first: "
                         "cmake --build build --target colibri; an absolute path is safest)" % " or ".join(tried))
    with open(src, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise SystemExit("COLIBRI_BUNDLE_LIBRARY: %s is not a shared library" % src)
    return src


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        src = bundled_library()
        dst = os.path.join(self.build_lib, "colibri", "libcolibri.so")
        if not src and os.path.exists(dst):
            os.unlink(dst)  # left by an earlier bundled build in the same tree
        if src:
            self.announce("bundling %s as %s" % (src, dst), level=2)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)


class MaybeBinaryDistribution(Distribution):
    def has_ext_modules(self):
        return bundled_library() is not None


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=MaybeBinaryDistribution)
