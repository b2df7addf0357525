#!/usr/bin/env bash
# A hash of the Python sources under the current directory (sorted paths and contents; caches, venvs and carried
# folders left out): the same files give the same hash here and on the device machine, whose .git may be stale.
find . \( -path ./.venv -o -path ./.df -o -path ./.whl -o -path ./.git -o -name __pycache__ \) -prune -o -name '*.py' -print \
  | LC_ALL=C sort | while read -r f; do echo "$f"; cat "$f"; done | sha1sum | cut -c1-12
