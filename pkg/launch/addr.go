package launch

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
)

// FreeAddr returns a loopback address with a port that was free a moment ago, for a listener
// that must keep its address across restarts (a Restartable's: the addresses its peers were
// given stay valid); a process started once takes 127.0.0.1:0 and reports its address in its
// ready file instead.
//
// The port comes from below the kernel's ephemeral range (ip_local_port_range), never from
// it: a port of that range freed here could be handed to any outgoing connection or ":0"
// listener before its process binds it ("address already in use" at set-up, seen once in the
// faults harness). Below the range only explicit binds compete; the ports given out are
// remembered, so one test process never gives a port twice.
func FreeAddr() (string, error) {
	lo := ephemeralStart()
	const base = 10000
	portMu.Lock()
	defer portMu.Unlock()
	for range 200 {
		port := base + rand.IntN(lo-base)
		if givenPorts[port] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue // taken by someone else: another
		}
		_ = l.Close()
		givenPorts[port] = true
		return l.Addr().String(), nil
	}
	return "", fmt.Errorf("no free loopback port below %d after 200 tries", lo)
}

var (
	portMu     sync.Mutex
	givenPorts = map[int]bool{}
)

// ephemeralStart is the first port of the kernel's ephemeral range (32768 where it cannot be
// read or makes no sense).
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > 12000 && n <= 65535 {
				return n
			}
		}
	}
	return 32768
}

// SupportsFlag reports whether bin lists --name in its -h output (a flag that older builds of
// a binary lack, such as --insecure).
func SupportsFlag(bin, name string) bool {
	cmd := exec.Command(bin, "-h")
	cmd.Env = ChildEnv()
	out, _ := cmd.CombinedOutput()
	return strings.Contains(string(out), "-"+name+" ") || strings.Contains(string(out), "-"+name+"\n")
}
