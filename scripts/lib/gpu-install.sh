# fedveil beside a GPU machine's own torch, the dependencies it lacks from a folder of wheels only (no
# network assumed): the install part that scripts/gpu-check and scripts/gpu-paper share. Sourced, not run.
#
#   source scripts/lib/gpu-install.sh
#   install_fedveil [EXTRA...]   EXTRA: requirements the caller needs beyond fedveil's (e.g. pytest)
#
# It reads the caller's PY (the Python to install into), WHEELS (the folder of wheels, made by
# scripts/gpu-wheels), log (a file for pip's output), root (the repository) and dry (1: a dry run), calls
# the caller's `say MESSAGE...`, and adds one to the caller's `failures` for a dry run whose wheels do not
# cover what its Python lacks. A dry run installs nothing: it says what the GPU machine would install and
# checks, with `pip install --dry-run --no-index`, that WHEELS covers what this Python lacks; it returns 2
# (after that check) when this Python cannot import fedveil, since the steps could not run. Otherwise
# install_fedveil returns 2 when torch sees no CUDA device (the caller stops), and 0 when it installed
# what it could (what it could not install is said: the steps that import it fail).

# missing_requirements [EXTRA...]: fedveil's requirements (and EXTRA's) that this Python lacks or has at
# another version, torch apart: the machine's own torch is the one to use.
missing_requirements() {
  "$PY" - "$@" <<'EOF'
import importlib.metadata as md
import pathlib
import sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
wanted = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["dependencies"] + sys.argv[1:]
for text in wanted:
    req = Requirement(text)
    if req.name == "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    try:
        ok = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(str(req))
EOF
}

# install_fedveil [EXTRA...]: the install (or, in a dry run, its check) described at the top.
install_fedveil() {
  local missing lacking
  if [ "$dry" = 1 ]; then
    say "would run: $PY -m pip install --no-deps --no-build-isolation -e . (the machine's torch stays)"
    lacking=$(missing_requirements "$@" 2>>"$log") || lacking="?"
    mapfile -t missing < <(printf '%s' "$lacking" | sed '/^$/d')
    if [ "$lacking" = "?" ]; then
      say "cannot tell what $PY lacks: it has neither pip nor packaging (see $log); install pip there"
      failures=$((failures + 1))
    elif [ "${#missing[@]}" = 0 ]; then
      say "dependencies this Python lacks: none"
    elif [ -d "$WHEELS" ] && "$PY" -m pip install -q --dry-run --no-index --find-links "$WHEELS" \
      "${missing[@]}" >>"$log" 2>&1; then
      say "dependencies this Python lacks: ${missing[*]}; the wheels in $WHEELS cover them (pip --dry-run)"
    else
      say "dependencies this Python lacks: ${missing[*]}; $WHEELS does not cover them (see $log): make the" \
        "wheels with scripts/gpu-wheels"
      failures=$((failures + 1))
    fi
    if ! "$PY" -c 'import fedveil' 2>>"$log"; then
      say "$PY cannot import fedveil, and a dry run installs nothing: its steps cannot run. Install it there" \
        "(pip install -e . -c constraints/cpu.txt) or set PYTHON to a Python that has it"
      return 2
    fi
    return 0
  fi
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>>"$log"; then
    say "torch sees no CUDA device here (or no torch at all): run scripts/$(basename "$0") --dry-run instead"
    return 2
  fi
  say "torch $("$PY" -c 'import torch; print(torch.__version__, "on", torch.cuda.get_device_name(0))')"
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1; then
    say "pip install --no-deps -e . failed (no setuptools?): fedveil runs from src/ on PYTHONPATH"
    export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
  mapfile -t missing < <(missing_requirements "$@")
  if [ "${#missing[@]}" -gt 0 ]; then
    say "missing: ${missing[*]}"
    if [ -d "$WHEELS" ] && "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}" \
      >>"$log" 2>&1; then
      say "installed them from $WHEELS"
    else
      say "could not install them from $WHEELS (no such folder, or wheels missing there): put their wheels" \
        "in it (pip download -d wheels ${missing[*]} on a machine with network); steps that import them fail"
    fi
  fi
}
