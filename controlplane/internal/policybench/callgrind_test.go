package policybench

// Callgrind's client requests (valgrind's callgrind.h: VG_USERREQ_TOOL_BASE('C','T') + n).
const (
	callgrindZeroStats       = 0x43540001
	callgrindStartInstrument = 0x43540004
	callgrindStopInstrument  = 0x43540005
)

// callgrindWindow confines valgrind --tool=callgrind --instr-atstart=no to what runs between
// it and the returned stop: instrumentation (and the counts, zeroed) starts here on every
// thread and stops at stop. Outside callgrind both are no-ops. The benchmarks of this package
// open one around their timed loop, so that a run's instruction count is the loop's and the
// set-up (the embedded etcd, 100,000 sessions) runs at valgrind's uninstrumented speed.
func callgrindWindow() (stop func()) {
	valgrindRequest(&[6]uintptr{callgrindStartInstrument})
	valgrindRequest(&[6]uintptr{callgrindZeroStats})
	return func() { valgrindRequest(&[6]uintptr{callgrindStopInstrument}) }
}
