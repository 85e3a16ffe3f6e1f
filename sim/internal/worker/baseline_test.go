package worker

import (
	"os"
	"path/filepath"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func seq(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

func TestChainHashesSharePrefix(t *testing.T) {
	a := chainHashes(seq(64, 0), 16)
	b := chainHashes(append(seq(40, 0), seq(24, 500)...), 16)
	if len(a) != 4 || len(b) != 4 {
		t.Fatalf("pages: %d %d", len(a), len(b))
	}
	for i, want := range []bool{true, true, false, false} {
		if (a[i] == b[i]) != want {
			t.Errorf("page %d equal=%v, want %v", i, a[i] == b[i], want)
		}
	}
}

func TestRadixLRU(t *testing.T) {
	r := newRadix(4, 16, EvictLRU)
	x := chainHashes(seq(48, 0), 16)   // 3 pages
	y := chainHashes(seq(48, 900), 16) // 3 other pages
	r.insert(x, 0)
	if got := r.match(x); got != 3 {
		t.Fatalf("match x = %d, want 3", got)
	}
	r.insert(y, 0) // 6 pages > 4: x's least recently used pages go
	if got := r.match(y); got != 3 {
		t.Errorf("match y = %d, want 3", got)
	}
	if got := r.match(x); got != 1 {
		t.Errorf("match x after eviction = %d, want 1 (its root page only)", got)
	}
	var nilR *radix
	nilR.insert(x, 0)
	if nilR.match(x) != 0 {
		t.Error("nil radix matched")
	}
}

// TestRadixEvictionPolicy: under "priority" the pages of the lowest priority go first, least
// recently used within a priority, and a page keeps the highest priority it was inserted at
// (SGLang 0.5.23's PriorityStrategy and TreeNode.priority = max); under "lru" priorities are
// ignored.
func TestRadixEvictionPolicy(t *testing.T) {
	x := chainHashes(seq(48, 0), 16)                          // 3 pages
	y := chainHashes(seq(48, 900), 16)                        // 3 other pages
	z := chainHashes(append(seq(32, 0), seq(16, 700)...), 16) // x's first 2 pages, then its own
	type ins struct {
		hs   []uint64
		prio int64
	}
	cases := []struct {
		name   string
		policy string
		seq    []ins
		x, y   int // pages of x and y matched afterwards (x first)
	}{
		{"lru: the older session goes although the newer is low", EvictLRU, []ins{{x, 0}, {y, -100}, {y, -100}}, 1, 3},
		{"priority: the low session goes although it is newer", EvictPriority, []ins{{x, 0}, {y, -100}}, 3, 1},
		{"priority: the normal session stays although older", EvictPriority, []ins{{x, 0}, {y, -100}, {y, -100}}, 3, 1},
		{"priority: equal priorities are LRU", EvictPriority, []ins{{x, -100}, {y, -100}}, 1, 3},
		{"priority: higher values stay (SGLang's sign)", EvictPriority, []ins{{x, 5}, {y, 0}}, 3, 1},
		{"priority: a page keeps its highest priority", EvictPriority, []ins{{x, 0}, {x, -100}, {y, -100}}, 3, 1},
		{"priority: a low page re-inserted at normal is raised", EvictPriority, []ins{{x, -100}, {y, -100}, {x, 0}, {y, -100}}, 3, 1},
		{"priority: a shared prefix keeps the higher one's priority", EvictPriority, []ins{{x, 0}, {z, -100}, {y, -100}}, 3, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRadix(4, 16, c.policy)
			for _, in := range c.seq {
				r.insert(in.hs, in.prio)
			}
			if r.n > r.cap || int64(len(r.idx)) != r.n {
				t.Fatalf("holds %d pages (index %d), capacity %d", r.n, len(r.idx), r.cap)
			}
			gx, gy := r.match(x), r.match(y)
			if gx != c.x || gy != c.y {
				t.Errorf("matched x=%d y=%d, want x=%d y=%d", gx, gy, c.x, c.y)
			}
		})
	}
	if _, err := NewBaseline(BaselineConfig{PrefixCacheTokens: 64, EvictionPolicy: "lfu"}, 16); err == nil {
		t.Error("an eviction policy kvc-sim does not model was accepted")
	}
}

func TestPrefillCostAndTiers(t *testing.T) {
	dir := t.TempDir()
	tier := filepath.Join(dir, "decode-0")
	tm := DefaultTiming()
	dec, err := NewBaseline(BaselineConfig{OffloadDir: tier, DecodeRadix: true, RadixTokens: 1 << 20, RestoreDirs: []string{tier}}, 16)
	if err != nil {
		t.Fatal(err)
	}
	pre, err := NewBaseline(BaselineConfig{PrefixCacheTokens: 1 << 20, PullDirs: []string{tier}}, 16)
	if err != nil {
		t.Fatal(err)
	}
	g := Geometry{PageSize: 16, Layers: 1, BytesPerToken: 1, PageCount: 1024}
	wp := &Worker{cfg: Config{Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Geometry: g, Timing: tm, Baseline: pre}}
	wd := &Worker{cfg: Config{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Geometry: g, Timing: tm, Baseline: dec}}
	ids1 := seq(160, 0)
	p1 := &plan{sessionID: "s", seedKey: "s", input: 160, ids: ids1}
	cases := []struct {
		name           string
		p              *plan
		cached, pulled int64
	}{
		{"cold", p1, 0, 0},
		{"same input again: cached but one token", p1, 159, 0},
	}
	for _, c := range cases {
		d, cached, pulled, _ := wp.prefillCost(c.p)
		if cached != c.cached || pulled != c.pulled {
			t.Errorf("%s: cached %d pulled %d, want %d %d", c.name, cached, pulled, c.cached, c.pulled)
		}
		if want := tm.Prefill(c.p.input - cached - pulled); d != want {
			t.Errorf("%s: cost %v, want %v", c.name, d, want)
		}
	}
	// The decode turn generated 40 tokens: its KV [0, 200) goes to the tier.
	td := &turn{p: &plan{sessionID: "s", seedKey: "s", input: 160, maxNew: 40, ids: ids1}, kv: 200}
	wd.baselineFinished(td)
	if _, err := os.Stat(tierFile(tier, "s")); err != nil {
		t.Fatalf("offload file: %v", err)
	}
	// Next turn: history (input + the generated ids) + 60 new tokens.
	ids2 := append(td.content(200), seq(60, 7000)...)
	p2 := &plan{sessionID: "s", seedKey: "s", input: 260, ids: ids2}
	_, cached, pulled, from := wp.prefillCost(p2)
	if cached != 160 || pulled != 32 || from != tier { // 160 own; tier holds 200 = 12 full pages = 192
		t.Errorf("next turn: cached %d pulled %d from %q, want 160 32 %q", cached, pulled, from, tier)
	}
	// The decode radix holds (the turn locked) 192 tokens of it: only the rest is received.
	if rp := wd.receivePlan(&turn{p: p2, radix: make([]*rnode, 12)}, kvcv1.TransferKind_TRANSFER_KIND_SEED, 260); rp != (recvPlan{have: 192}) {
		t.Errorf("receive: %+v, want have 192 and no restore", rp)
	}
	// A new decode worker restores from the tier.
	wd2 := &Worker{cfg: Config{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Geometry: g, Timing: tm,
		Baseline: &Baseline{cfg: BaselineConfig{DecodeRadix: true, RestoreDirs: []string{tier}}}}}
	if rp := wd2.receivePlan(&turn{p: p2}, kvcv1.TransferKind_TRANSFER_KIND_SEED, 260); rp != (recvPlan{have: 192, restore: 192, restoreFrom: tier}) {
		t.Errorf("restore: %+v", rp)
	}
	// The node dies with its tier: nothing to pull any more.
	if err := os.RemoveAll(tier); err != nil {
		t.Fatal(err)
	}
	pre2, _ := NewBaseline(BaselineConfig{PullDirs: []string{tier}}, 16)
	wp.cfg.Baseline = pre2
	if _, cached, pulled, _ := wp.prefillCost(p2); cached != 0 || pulled != 0 {
		t.Errorf("after node loss: cached %d pulled %d", cached, pulled)
	}
	// Plain kvc-sim: no baseline, whole input.
	wp.cfg.Baseline = nil
	if d, _, _, _ := wp.prefillCost(p2); d != tm.Prefill(260) {
		t.Errorf("no baseline: %v", d)
	}
}

// TestPrefillCostPriority: a prefill's request priority (plan.priority, SGLang's priority field)
// decides which session P's prefix cache keeps under "priority"; under "lru" the older goes.
func TestPrefillCostPriority(t *testing.T) {
	g := Geometry{PageSize: 16, Layers: 1, BytesPerToken: 1, PageCount: 1024}
	normal := &plan{sessionID: "n", seedKey: "n", input: 64, ids: seq(64, 0)}                    // 4 pages, P will see it again
	direct := &plan{sessionID: "d", seedKey: "d", input: 64, ids: seq(64, 5000), priority: -100} // bound direct-to-D
	for _, c := range []struct {
		policy string
		want   int64 // the normal session's cached tokens on its next prefill
	}{
		{EvictLRU, 32}, // its two deepest pages went
		{EvictPriority, 63},
	} {
		t.Run(c.policy, func(t *testing.T) {
			b, err := NewBaseline(BaselineConfig{PrefixCacheTokens: 96, EvictionPolicy: c.policy}, 16) // 6 pages
			if err != nil {
				t.Fatal(err)
			}
			w := &Worker{cfg: Config{Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Geometry: g, Timing: DefaultTiming(), Baseline: b}}
			w.prefillCost(normal)
			w.prefillCost(direct) // 8 pages > 6: two go
			if _, cached, _, _ := w.prefillCost(normal); cached != c.want {
				t.Errorf("normal session's next prefill: %d cached, want %d", cached, c.want)
			}
		})
	}
}
