package kvpool_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/kvxfer/kvxfertest"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

const helperEnv = "KVC_KVPOOL_TEST_HELPER"

var spec = kvpool.Spec{PageSize: 4, ItemLen: 4 * 40, NumLayers: 3, PageCount: 32, Name: "kvc-test"}

// TestHelperProcess is the "worker" of TestWorkerPoolAcrossProcesses (it does nothing in a normal
// run): it creates its pool in the directory named by the environment (or a memfd), prints
// "READY path offset0 offset1 ...", then answers "CHECK seed from to page..." lines with the number
// of (token, buffer) slots that do not hold the session's bytes, until stdin closes.
func TestHelperProcess(t *testing.T) {
	dir := os.Getenv(helperEnv)
	if dir == "" {
		t.Skip("helper process only")
	}
	p, err := kvpool.Create(dir, spec)
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	defer p.Close()
	fields := []string{"READY", p.Path()}
	for i := 0; i < p.NumBuffers(); i++ {
		fields = append(fields, strconv.FormatInt(p.Offset(i), 10))
	}
	fmt.Println(strings.Join(fields, " "))
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) < 4 || f[0] != "CHECK" {
			fmt.Println("ERR bad command")
			continue
		}
		seed, _ := strconv.ParseUint(f[1], 10, 64)
		from, _ := strconv.ParseInt(f[2], 10, 64)
		to, _ := strconv.ParseInt(f[3], 10, 64)
		var pages []int64
		for _, s := range f[4:] {
			v, _ := strconv.ParseInt(s, 10, 64)
			pages = append(pages, v)
		}
		bad, err := kvpool.CheckTokens(p, seed, pages, from, to)
		if err != nil {
			fmt.Println("ERR", err)
			continue
		}
		fmt.Println("MISMATCHES", bad)
	}
	p.Close()
	os.Exit(0)
}

// TestWorkerPoolAcrossProcesses: a worker process owns its KV pool in shared memory; the sidecar
// (this process) maps it and registers it with its transfer engine; a peer engine WRITEs a
// session's KV into it; the worker process itself finds every byte in its own memory.
func TestWorkerPoolAcrossProcesses(t *testing.T) {
	for _, dir := range []string{t.TempDir(), kvpool.MemfdDir} {
		t.Run(dir, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
			cmd.Env = append(os.Environ(), helperEnv+"="+dir)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				stdin.Close()
				_ = cmd.Wait()
			}()
			out := bufio.NewReader(stdout)
			line, err := out.ReadString('\n')
			if err != nil {
				t.Fatalf("worker: %v", err)
			}
			f := strings.Fields(line)
			if len(f) != 2+2*spec.NumLayers || f[0] != "READY" {
				t.Fatalf("worker said %q", line)
			}

			// The sidecar maps every buffer of the worker's pool and registers it.
			bufLen := int64(spec.PageCount) * int64(spec.ItemLen)
			l := rdma.Layout{PageSize: spec.PageSize, ItemLen: spec.ItemLen, NumLayers: spec.NumLayers, PageCount: spec.PageCount}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			sidecar, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Layout: &l})
			if err != nil {
				t.Fatal(err)
			}
			defer sidecar.Close()
			for _, s := range f[2:] {
				off, _ := strconv.ParseInt(s, 10, 64)
				m, err := kvpool.Map(f[1], off, bufLen)
				if err != nil {
					t.Fatal(err)
				}
				defer m.Close()
				l.BufferAddrs = append(l.BufferAddrs, m.Addr())
				if err := sidecar.RegisterMemory(rdma.Region{Addr: m.Addr(), Len: m.Len(), Kind: rdma.MemShared, Location: f[1]}); err != nil {
					t.Fatal(err)
				}
			}

			// A peer holds the session in its own pool and writes it into the worker's pages.
			src, err := kvpool.Arena(bufLen * int64(l.NumBuffers()))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			sl := rdma.Layout{PageSize: l.PageSize, ItemLen: l.ItemLen, NumLayers: l.NumLayers, PageCount: l.PageCount}
			var bufs [][]byte
			for i := 0; i < l.NumBuffers(); i++ {
				sl.BufferAddrs = append(sl.BufferAddrs, src.Addr()+uint64(i)*uint64(bufLen))
				bufs = append(bufs, src.Bytes()[int64(i)*bufLen:int64(i+1)*bufLen])
			}
			view, err := kvpool.NewView(sl, bufs)
			if err != nil {
				t.Fatal(err)
			}
			const tokens = 37
			seed := kvpool.SessionSeed("across-processes")
			srcPages := []int64{3, 4, 5, 9, 20, 21, 22, 30, 31, 0}
			dstPages := []int64{7, 8, 1, 2, 3, 11, 12, 13, 25, 26}
			if err := kvpool.FillTokens(view, seed, srcPages, 0, tokens); err != nil {
				t.Fatal(err)
			}
			peer, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Layout: &sl})
			if err != nil {
				t.Fatal(err)
			}
			defer peer.Close()
			if err := peer.RegisterMemory(rdma.Region{Addr: src.Addr(), Len: src.Len(), Kind: rdma.MemHost}); err != nil {
				t.Fatal(err)
			}
			seg, err := peer.OpenSegment(ctx, sidecar.SegmentName())
			if err != nil {
				t.Fatal(err)
			}
			reqs, err := kvxfertest.Requests(kvxfer.PageMap{Layout: sl.ToProto(), Pages: srcPages}, kvxfer.PageMap{Layout: l.ToProto(), Pages: dstPages}, seg, 0, tokens)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := kvxfer.Transfer(ctx, peer, reqs); err != nil {
				t.Fatal(err)
			}

			check := func(from, to int64, pages []int64) string {
				cmd := fmt.Sprintf("CHECK %d %d %d", seed, from, to)
				for _, p := range pages {
					cmd += " " + strconv.FormatInt(p, 10)
				}
				if _, err := fmt.Fprintln(stdin, cmd); err != nil {
					t.Fatal(err)
				}
				ans, err := out.ReadString('\n')
				if err != nil {
					t.Fatal(err)
				}
				return strings.TrimSpace(ans)
			}
			if got := check(0, tokens, dstPages); got != "MISMATCHES 0" {
				t.Fatalf("worker checked its pool: %s", got)
			}
			// And the check can fail: tokens beyond what was written are not the session's.
			if got := check(tokens, 40, dstPages); got != fmt.Sprintf("MISMATCHES %d", (40-tokens)*l.NumBuffers()) {
				t.Fatalf("worker checked unwritten tokens: %s", got)
			}
		})
	}
}
