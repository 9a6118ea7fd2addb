# Sourced by scripts/gpu_suite.sh and scripts/sanitize.sh (needs $REPO): an importable copy of the
# package in a temporary folder (ops/ and meta_kernels/ inside it, as the wheel lays them out), so
# nothing needs pip or a network; wheels placed in .whl/ (expecttest, say) are installed beside it.
# Exports PYTHONPATH and changes into the copy: not the repo root, where the source package lacks ops/
# and would shadow the copy.
SITE=$(mktemp -d)
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$REPO"/.whl/*.whl || exit 1
fi
cp -r "$REPO/torch_sparse_mla" "$SITE/" && cp -r "$REPO/ops" "$REPO/meta_kernels" "$SITE/torch_sparse_mla/"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$SITE" || exit 1
