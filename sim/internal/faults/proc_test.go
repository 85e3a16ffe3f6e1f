package faults

import (
	"net"
	"strconv"
	"testing"
)

// TestFreeAddr: the harness's fixed ports are distinct, bindable and below the kernel's
// ephemeral range (where no outgoing connection or ":0" listener can take them first).
func TestFreeAddr(t *testing.T) {
	lo := ephemeralStart()
	seen := map[string]bool{}
	for range 20 {
		a, err := freeAddr()
		if err != nil {
			t.Fatal(err)
		}
		if seen[a] {
			t.Fatalf("%s given twice", a)
		}
		seen[a] = true
		_, ps, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		if p, _ := strconv.Atoi(ps); p >= lo || p < 10000 {
			t.Fatalf("port %d outside [10000, %d)", p, lo)
		}
		l, err := net.Listen("tcp", a)
		if err != nil {
			t.Fatalf("%s not bindable: %v", a, err)
		}
		_ = l.Close()
	}
}
