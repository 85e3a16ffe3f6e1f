package state

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestPolicyBounded is issue 16 finding 5: per-worker overrides only for known workers, a
// capped count checked before the write, removals always accepted, nothing stored on refusal.
func TestPolicyBounded(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	if _, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE)); err != nil {
		t.Fatal(err)
	}
	perWorker := func(m map[string]int32) *kvcv1.Policy {
		return &kvcv1.Policy{MaxConcurrentTransfersPerWorker: m}
	}
	for _, tc := range []struct {
		name    string
		update  *kvcv1.Policy
		wantErr error
		want    map[string]int32 // stored overrides after the call
	}{
		{"known worker", perWorker(map[string]int32{"d0": 2}), nil, map[string]int32{"d0": 2}},
		{"unknown worker", perWorker(map[string]int32{"ghost-1": 2}), ErrInvalidPolicy, map[string]int32{"d0": 2}},
		{"unknown among known", perWorker(map[string]int32{"d0": 3, "ghost-2": 1}), ErrInvalidPolicy, map[string]int32{"d0": 2}},
		{"removal of an unknown id is fine", perWorker(map[string]int32{"ghost-3": -1}), nil, map[string]int32{"d0": 2}},
		{"removal", perWorker(map[string]int32{"d0": -1}), nil, map[string]int32{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := st.UpdatePolicy(t.Context(), tc.update)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("err %v, want %v", err, tc.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), "ghost") {
				t.Fatalf("error does not name the unknown worker: %v", err)
			}
			stored, _, serr := f.store.GetPolicy(t.Context())
			if serr != nil {
				t.Fatal(serr)
			}
			got := stored.GetMaxConcurrentTransfersPerWorker()
			if len(got) != len(tc.want) {
				t.Fatalf("stored overrides %v, want %v", got, tc.want)
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Fatalf("stored overrides %v, want %v", got, tc.want)
				}
			}
		})
	}

	// The count cap: MaxPolicyOverrides known workers fit, one more is RESOURCE_EXHAUSTED
	// material (ErrPolicyTooLarge), checked before anything is written.
	all := map[string]int32{}
	for i := 0; i <= MaxPolicyOverrides; i++ {
		id := fmt.Sprintf("w%05d", i)
		if _, err := st.Attach(hello(id, kvcv1.WorkerRole_WORKER_ROLE_DECODE)); err != nil {
			t.Fatal(err)
		}
		all[id] = 1
	}
	first := map[string]int32{}
	for id := range all {
		if len(first) == MaxPolicyOverrides {
			break
		}
		first[id] = 1
	}
	p, err := st.UpdatePolicy(t.Context(), perWorker(first))
	if err != nil {
		t.Fatalf("%d overrides: %v", MaxPolicyOverrides, err)
	}
	if proto.Size(p) > MaxPolicyBytes {
		t.Fatalf("policy of %d bytes passed the %d byte bound", proto.Size(p), MaxPolicyBytes)
	}
	version := p.GetVersion()
	_, err = st.UpdatePolicy(t.Context(), perWorker(all))
	if !errors.Is(err, ErrPolicyTooLarge) || !strings.Contains(err.Error(), "limit 1024") {
		t.Fatalf("%d overrides: %v, want ErrPolicyTooLarge", len(all), err)
	}
	stored, _, err := f.store.GetPolicy(t.Context())
	if err != nil || stored.GetVersion() != version || len(stored.GetMaxConcurrentTransfersPerWorker()) != MaxPolicyOverrides {
		t.Fatalf("refused update changed the stored policy: v%d, %d overrides, %v", stored.GetVersion(), len(stored.GetMaxConcurrentTransfersPerWorker()), err)
	}
}
