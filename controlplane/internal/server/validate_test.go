package server

import (
	"strings"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestValidateHelloTensorParallelism(t *testing.T) {
	base := func(f func(h *kvcv1.Hello)) *kvcv1.Hello {
		h := &kvcv1.Hello{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}
		f(h)
		return h
	}
	tests := []struct {
		name string
		h    *kvcv1.Hello
		want string // "" = valid
	}{
		{"no tensor parallelism", base(func(*kvcv1.Hello) {}), ""},
		{"tp 1 with a group", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpSize = "g", 1 }), ""},
		{"rank 3 of 4", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpRank, h.TpSize = "http://w:31000", 3, 4 }), ""},
		{"no group", base(func(h *kvcv1.Hello) { h.TpRank, h.TpSize = 1, 2 }), "tp_size 2 without tp_group"},
		{"rank = size", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpRank, h.TpSize = "g", 2, 2 }), "tp_rank 2 out of range [0, 2)"},
		{"rank without size", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpRank = "g", 1 }), "tp_rank 1 out of range [0, 1)"},
		{"negative rank", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpRank, h.TpSize = "g", -1, 2 }), "tp_rank -1"},
		{"size too large", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpSize = "g", maxTPSize+1 }), "tp_size 1025 out of range"},
		{"negative size", base(func(h *kvcv1.Hello) { h.TpSize = -2 }), "tp_size -2 out of range"},
		{"group too long", base(func(h *kvcv1.Hello) { h.TpGroup, h.TpSize = strings.Repeat("g", maxStrLen+1), 2 }), "tp_group is 1025 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := validateHello(tt.h)
			if (tt.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.want)) {
				t.Fatalf("validateHello: %v, want %q", err, tt.want)
			}
		})
	}
}
