package faults

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestCheckHistory(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	op := func(kind opKind, w string, call, ret int) Op {
		return Op{Session: "s", Kind: kind, Worker: w, Call: at(call), Return: at(ret), Source: "test"}
	}
	tests := []struct {
		name    string
		ops     []Op
		illegal bool
		lost    int
	}{
		{"write then read it", []Op{op(opWrite, "d0", 0, 10), op(opRead, "d0", 20, 30)}, false, 0},
		{"write forgotten", []Op{op(opWrite, "d0", 0, 10), op(opRead, "", 20, 30)}, true, 1},
		{"write overwritten by a phantom", []Op{op(opWrite, "d0", 0, 10), op(opRead, "d1", 20, 30)}, true, 1},
		{"read concurrent with the write may see the old value",
			[]Op{op(opWrite, "d0", 0, 10), op(opWrite, "d1", 20, 40), op(opRead, "d0", 25, 30)}, false, 0},
		{"stale read after a newer write returned",
			[]Op{op(opWrite, "d0", 0, 10), op(opWrite, "d1", 20, 30), op(opRead, "d0", 40, 50)}, true, 1},
		{"a drop of the worker explains the empty read",
			[]Op{op(opWrite, "d0", 0, 10), op(opDrop, "d0", 15, 35), op(opRead, "", 40, 50)}, false, 0},
		{"a drop of another worker explains nothing",
			[]Op{op(opWrite, "d0", 0, 10), op(opDrop, "d1", 15, 35), op(opRead, "", 40, 50)}, true, 0},
		{"a failed request may have written",
			[]Op{op(opWrite, "d0", 0, 10), op(opMaybe, "d1", 15, 35), op(opRead, "d1", 40, 50)}, false, 0},
		{"a failed request may have dropped",
			[]Op{op(opWrite, "d0", 0, 10), op(opMaybe, "", 15, 35), op(opRead, "", 40, 50)}, false, 0},
		{"two workers at once (read d0 and d1 with no write between)",
			[]Op{op(opWrite, "d0", 0, 10), op(opRead, "d0", 20, 30), op(opRead, "d1", 40, 50), op(opRead, "d0", 60, 70)}, true, 1},
		{"seed of a new session", []Op{op(opSeed, "d0", 0, 10), op(opRead, "d0", 20, 30)}, false, 0},
		{"seed of a session acked resident: forgotten",
			[]Op{op(opSeed, "d0", 0, 10), op(opRead, "d0", 20, 30), op(opSeed, "d1", 40, 50)}, true, 1},
		{"seed after a legitimate drop",
			[]Op{op(opWrite, "d0", 0, 10), op(opDrop, "d0", 15, 35), op(opSeed, "d1", 40, 50)}, false, 0},
		{"initial state is not resident", []Op{op(opRead, "", 0, 10)}, false, 0},
		{"a re-home (the control plane's write) explains the read on the new worker",
			[]Op{op(opWrite, "d0", 0, 10), op(opDrop, "d0", 15, 60), op(opWrite, "d1", 20, 30), op(opRead, "d1", 40, 50)}, false, 0},
		{"without the re-home the read on another worker is a phantom",
			[]Op{op(opWrite, "d0", 0, 10), op(opDrop, "d0", 15, 60), op(opRead, "d1", 40, 50)}, true, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := CheckHistory(tc.ops, 5*time.Second)
			if got := len(v.Illegal) > 0; got != tc.illegal {
				t.Errorf("illegal = %v, want %v", got, tc.illegal)
			}
			if v.Lost != tc.lost {
				t.Errorf("lost = %d, want %d (%v)", v.Lost, tc.lost, v.LostDetails)
			}
			if len(v.Unknown) != 0 {
				t.Errorf("checker gave up: %v", v.Unknown)
			}
		})
	}
}

func TestOpsFromResults(t *testing.T) {
	t0 := time.Now()
	rs := []Result{
		{Session: "a", OK: true, Status: 200, Mode: "SEED", Worker: "d0"},
		{Session: "a", OK: true, Status: 200, Mode: "DIRECT_TO_D", Worker: "d0"},
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d1"},
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_PREFILL", Worker: "d2"},
		{Session: "a", OK: true, Status: 200, Mode: "PD_FALLBACK", Worker: "d2", FailOpen: true},
		{Session: "a", OK: true, Status: 200, Mode: "PD_FALLBACK", Worker: "d2"},
		{Session: "a", Status: 502, Mode: "SEED", Worker: "d1"},
		{Session: "a", Status: 502, Mode: "DIRECT_TO_D", Worker: "d1"},
		{Session: "a", Err: "transport: refused"},
		// Resumed mid-stream: DIRECT_TO_D on d1 died, the continuation reseeded onto d2.
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d2", ResumedFrom: "d1", FirstMode: "DIRECT_TO_D"},
		// … a failed-open first attempt (no op), its continuation decided.
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_PREFILL", Worker: "d0", ResumedFrom: "d2", FirstMode: "PD_FALLBACK", FirstFailOpen: true},
		// Retried: the attempt on d1 failed before its first token, the retry reseeded onto d2.
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d2", Retries: 1, RetriedFrom: []string{"d1"}},
		// Retried twice, then failed on d0.
		{Session: "a", Status: 502, Mode: "SEED", Worker: "d0", Retries: 2, RetriedFrom: []string{"d1", "d2"}},
		// Retried before the first token (d0), resumed from d1 mid-stream, the continuation
		// retried off d2 and finished on d0.
		{Session: "a", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d0", RetriedFrom: []string{"d0"},
			ResumedFrom: "d1", FirstMode: "DIRECT_TO_D", ResumedRetriedFrom: []string{"d2"}},
	}
	for i := range rs {
		rs[i].Call, rs[i].Return = t0, t0
	}
	want := []struct {
		kind opKind
		w    string
	}{{opSeed, "d0"}, {opRead, "d0"}, {opWrite, "d1"}, {opWrite, "d2"}, {opMaybe, ""}, {opMaybe, "d1"}, {opMaybe, ""}, {opMaybe, ""},
		{opMaybe, ""}, {opWrite, "d2"}, {opWrite, "d0"},
		{opMaybe, "d1"}, {opWrite, "d2"},
		{opMaybe, "d1"}, {opMaybe, "d2"}, {opMaybe, "d0"},
		{opMaybe, "d0"}, {opMaybe, "d2"}, {opMaybe, ""}, {opWrite, "d0"}}
	got := OpsFromResults(rs)
	if len(got) != len(want) {
		t.Fatalf("%d ops, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		if got[i].Kind != w.kind || got[i].Worker != w.w {
			t.Errorf("op %d = %s(%q), want %s(%q)", i, got[i].Kind, got[i].Worker, w.kind, w.w)
		}
	}
}

// TestRetriedAttemptsInTheHistory: a request the gateway retried onto another decode worker
// was a decision on each worker it tried. The control plane may have made the session resident
// on the first one (its sidecar's LOADED applied after the failed outcome): a later read on it
// is explained by the retried attempt, not a phantom; a read on a worker no attempt tried still
// is.
func TestRetriedAttemptsInTheHistory(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	retried := Result{Session: "s", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d2", Retries: 1,
		RetriedFrom: []string{"d1"}, Call: at(0), Return: at(100)}
	read := func(w string) Op {
		return Op{Session: "s", Kind: opRead, Worker: w, Call: at(200), Return: at(210), Source: "GetSession"}
	}
	resumed := Result{Session: "s", OK: true, Status: 200, Mode: "RESEED_SNAPSHOT", Worker: "d2", ResumedFrom: "d0",
		FirstMode: "SEED", ResumedRetriedFrom: []string{"d1"}, Call: at(0), Return: at(100)}
	for _, tc := range []struct {
		name    string
		res     Result
		read    string
		illegal bool
		lost    int
	}{
		{"read on the last attempt's worker", retried, "d2", false, 0},
		{"read on the retried attempt's worker", retried, "d1", false, 0},
		// Not linearizable; not counted lost: the retried attempt overlaps the write (lostWrites).
		{"read on a worker no attempt tried", retried, "d0", true, 0},
		{"read on the resumed continuation's retried worker", resumed, "d1", false, 0},
		{"read on a worker no continuation tried", resumed, "d3", true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := CheckHistory(append(OpsFromResults([]Result{tc.res}), read(tc.read)), 5*time.Second)
			if got := len(v.Illegal) > 0; got != tc.illegal {
				t.Errorf("illegal = %v, want %v", got, tc.illegal)
			}
			if v.Lost != tc.lost {
				t.Errorf("lost = %d, want %d (%v)", v.Lost, tc.lost, v.LostDetails)
			}
		})
	}
}

// FuzzCheckHistory decodes arbitrary bytes into a one-session history (4 bytes an operation:
// kind, worker, call offset, duration) and checks the checker's invariants: it never panics,
// gives a verdict, and a history it calls linearizable has no lost write.
func FuzzCheckHistory(f *testing.F) {
	f.Add([]byte{0, 1, 0, 5, 1, 1, 10, 2})
	f.Add([]byte{4, 1, 0, 5, 1, 0, 10, 2, 4, 2, 20, 3})
	f.Add([]byte{0, 1, 0, 5, 3, 1, 6, 9, 1, 0, 20, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4*24 {
			b = b[:4*24]
		}
		t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		workers := []string{"", "d0", "d1", "d2"}
		var ops []Op
		for i := 0; i+3 < len(b); i += 4 {
			call := t0.Add(time.Duration(b[i+2]) * time.Millisecond)
			ops = append(ops, Op{Session: "s", Kind: opKind(b[i] % 5), Worker: workers[b[i+1]%4],
				Call: call, Return: call.Add(time.Duration(b[i+3]) * time.Millisecond)})
		}
		v := CheckHistory(ops, 2*time.Second)
		if v.Ops != len(ops) {
			t.Fatalf("%d ops checked of %d", v.Ops, len(ops))
		}
		if len(v.Illegal) == 0 && len(v.Unknown) == 0 && v.Lost > 0 {
			t.Fatalf("linearizable history with %d lost writes: %v", v.Lost, v.LostDetails)
		}
	})
}

func TestCheckHistoryVisualize(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ops := []Op{
		{Session: "bad", Kind: opWrite, Worker: "d0", Call: t0, Return: t0.Add(10 * time.Millisecond)},
		{Session: "bad", Kind: opRead, Worker: "", Call: t0.Add(20 * time.Millisecond), Return: t0.Add(30 * time.Millisecond)},
		{Session: "good", Kind: opSeed, Worker: "d1", Call: t0, Return: t0.Add(10 * time.Millisecond)},
	}
	dir := t.TempDir()
	v := CheckHistoryVisualize(ops, 5*time.Second, dir)
	if len(v.Illegal) != 1 || v.Illegal[0] != "bad" {
		t.Fatalf("illegal %v", v.Illegal)
	}
	if st, err := os.Stat(filepath.Join(dir, "bad.html")); err != nil || st.Size() == 0 {
		t.Fatalf("no visualization of the illegal session: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "good.html")); err == nil {
		t.Fatal("a visualization of a linearizable session")
	}
}
