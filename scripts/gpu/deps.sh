# Sourced by the GPU scripts before their first run: the wheels in the repository's .whl/ (a machine
# without network carries there the packages its image lacks; mxmoe's trainer needs tyro, with
# docstring_parser and typeguard: scripts/torchtitan_h200.sh lists the versions) are installed into
# /tmp/site, put on PYTHONPATH; then mxmoe's run-time dependencies are checked, and a missing one
# stops the script (exit 2) before any run, naming it (each run would fail on its own otherwise).
_deps_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if compgen -G "$_deps_repo/.whl/*.whl" > /dev/null; then
    "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$_deps_repo"/.whl/*.whl && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
"${PY:-python3}" - <<'PYEOF' || exit 2
import importlib.util, sys
missing = [m for m in ("tabulate", "tqdm", "tyro") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"mxmoe needs {', '.join(missing)} (pyproject.toml's dependencies), not installed for "
             f"{sys.executable}: pip install them, or carry their wheels in .whl/ (scripts/gpu/deps.sh)")
PYEOF
