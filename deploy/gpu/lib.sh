# Shared by run-real.sh and run-fromsnap.sh (sourced from the repository root, after BIN and PY
# are set): the carried binaries and the devices of a real-model GPU run.

# real_binaries unpacks bin/real.tar.xz when BIN has no kvc-bench yet, then exits 2 naming the
# first binary kvc-bench starts that is missing.
real_binaries() {
	if [[ ! -x $BIN/kvc-bench && -f bin/real.tar.xz ]]; then
		echo "unpacking bin/real.tar.xz"
		tar -C bin -xJf bin/real.tar.xz 2>/dev/null || "$PY" -c 'import tarfile; tarfile.open("bin/real.tar.xz").extractall("bin")'
	fi
	local b
	for b in kvc-bench kvc-controlplane kvc-sidecar-prefill kvc-sidecar-decode kvc-gateway; do
		if [[ ! -x $BIN/$b ]]; then
			echo "missing $BIN/$b: run 'bash deploy/gpu/prepare-real.sh' on a machine with Go and carry bin/real.tar.xz" >&2
			exit 2
		fi
	done
}

# real_devices sets KVC_REAL_DEVICES to every GPU nvidia-smi lists (cuda:0,...) unless it is set;
# with no GPU it exits 2 with the dry run's settings.
real_devices() {
	if [[ -n ${KVC_REAL_DEVICES:-} ]]; then
		return
	fi
	local g
	g=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
	if [[ $g -lt 1 ]]; then
		echo "no GPU listed by nvidia-smi: set KVC_REAL_DEVICES=cpu KVC_REAL_SIDECAR_ARGS='--transport tcp' KVC_REAL_MODEL=tiny for a dry run" >&2
		exit 2
	fi
	KVC_REAL_DEVICES=$(seq -s, -f 'cuda:%g' 0 $((g - 1)))
}
