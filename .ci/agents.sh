#!/usr/bin/env bash
# The real agent CLIs the end-to-end tests drive (pinned to the versions HOOKS.md was checked against).
set -euo pipefail
cd "$(dirname "$0")/.."
npm install --prefix .agents --no-audit --no-fund --save-exact \
  @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 >/dev/null
