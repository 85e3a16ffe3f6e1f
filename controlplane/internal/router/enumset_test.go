package router

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestEnumSetsMatchTheNameMaps: the outcome's enum checks accept exactly the values the
// generated name maps hold.
func TestEnumSetsMatchTheNameMaps(t *testing.T) {
	for _, tc := range []struct {
		name  string
		set   enumSet
		names map[int32]string
	}{
		{"error_kind", knownErrorKinds, kvcv1.RouteErrorKind_name},
		{"executed_mode", knownModes, kvcv1.RouteMode_name},
	} {
		for v := int32(-3); v < int32(len(tc.names))+3; v++ {
			_, want := tc.names[v]
			if got := tc.set.has(v); got != want {
				t.Errorf("%s %d: has %v, want %v", tc.name, v, got, want)
			}
		}
		for _, v := range []int32{1 << 30, -1 << 31} {
			if tc.set.has(v) {
				t.Errorf("%s %d accepted", tc.name, v)
			}
		}
	}
}
