#!/usr/bin/env bash
# The newest-releases check (.ci/run): the newest transformers and peft the registry serves, torch at the tested
# pin (scripts/setup_newest_env.sh, ./.venv-newest), running the tests that pin every transformers and peft name the
# package touches (tests/upstream_surface.py). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_newest_env.sh
mapfile -t TESTS < <(.venv-newest/bin/python tests/upstream_surface.py)
exec .venv-newest/bin/python -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
