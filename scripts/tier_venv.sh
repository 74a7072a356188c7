# Sourced by scripts/setup_vllm.sh and scripts/setup_verl.sh: a test tier's own virtual environment in the
# repo root, idempotent by stamp. The caller sets TIER (its name in messages) and VENV, then calls
# `tier_begin`, installs with `pip`, and ends with `tier_done`.
# The stamp in the venv records a hash of the inputs (the calling script, this file, pyproject.toml,
# constraints.txt, the Python version); when it matches, tier_begin exits the script: nothing runs.
# Python: python3.11 from PATH, or $PYTHON. No root needed.

PY=${PYTHON:-python3.11}
EXTRA_TOOLS=("pytest>=8" "pytest-timeout>=2.3")

say() { echo "setup_$TIER: $*"; }
fail() { echo "setup_$TIER: ERROR: $*" >&2; exit 1; }
pip() { "$VENV/bin/python" -m pip "$@"; }
# a pip run that builds this checkout (gradloc, editable): one at a time across the set-up scripts, which
# scripts/setup.sh runs side by side — setuptools writes gradloc.egg-info into the tree while it builds
pip_building_gradloc() { flock pyproject.toml "$VENV/bin/python" -m pip "$@"; }

tier_begin() {  # $1: the calling script (its text is part of the stamp)
  command -v "$PY" >/dev/null || fail "no '$PY' on PATH (set PYTHON=/path/to/python3.11)"
  pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || fail "'$PY' does not run"
  stamp=$VENV/.gradloc-$TIER-setup
  want=$( (cat "$1" scripts/tier_venv.sh pyproject.toml constraints.txt; echo "$pyver") | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    say "up to date ($VENV, stamp $want); nothing to do"
    exit 0
  fi
  start=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PY (Python $pyver)"
    "$PY" -m venv "$VENV" || fail "could not create the virtual environment $VENV"
  else
    say "reusing $VENV (inputs changed or the last run did not finish)"
  fi
  # git ignores the whole environment through its own .gitignore (Python 3.13's venv writes the same file)
  echo '*' > "$VENV/.gitignore"
}

tier_done() {
  echo "$want" > "$stamp"
  say "done in $(( $(date +%s) - start )) s; $VENV is $(du -sh "$VENV/" | cut -f1)"
}
