package faults

import (
	"testing"
	"time"
)

// TestKilledMidStream: only a request streaming from a worker the fault killed, when it was
// killed, with the gateway's broken-stream error, is excused; any other failure still fails the
// criterion.
func TestKilledMidStream(t *testing.T) {
	kill := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	broken := "stream error WORKER_ERROR worker_unreachable: decode worker: decode stream: unexpected EOF"
	for _, tc := range []struct {
		name string
		res  Result
		want bool
	}{
		{"streaming on the killed worker", Result{Worker: "decode-1", Call: kill.Add(-time.Second), Return: kill.Add(time.Second), Err: broken}, true},
		{"another worker", Result{Worker: "decode-0", Call: kill.Add(-time.Second), Return: kill.Add(time.Second), Err: broken}, false},
		{"started after the kill", Result{Worker: "decode-1", Call: kill.Add(time.Millisecond), Return: kill.Add(time.Second), Err: broken}, false},
		{"ended before the kill", Result{Worker: "decode-1", Call: kill.Add(-2 * time.Second), Return: kill.Add(-time.Second), Err: broken}, false},
		{"another error", Result{Worker: "decode-1", Call: kill.Add(-time.Second), Return: kill.Add(time.Second), Err: "503 no_capacity"}, false},
		{"no worker", Result{Call: kill.Add(-time.Second), Return: kill.Add(time.Second), Err: broken}, false},
		{"succeeded", Result{OK: true, Worker: "decode-1", Call: kill.Add(-time.Second), Return: kill.Add(time.Second)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := killedMidStream(tc.res, []string{"decode-1"}, kill); got != tc.want {
				t.Fatalf("killedMidStream = %v, want %v", got, tc.want)
			}
		})
	}
}
