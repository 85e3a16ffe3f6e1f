package hatest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// metric scrapes p's /metrics and returns the sample named exactly series (name plus its
// label set as Prometheus prints it, e.g. `kvc_kvstore_txns_total{result="ok"}`); 0 when
// absent (a labelled counter appears on first use).
func metric(t *testing.T, p *proc, series string) float64 {
	t.Helper()
	v, err := scrape(t.Context(), p, series)
	if err != nil {
		t.Fatalf("%s metrics: %v", p.node, err)
	}
	return v
}

func scrape(ctx context.Context, p *proc, series string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.httpAddr+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, series+" ") {
			return strconv.ParseFloat(strings.TrimSpace(line[len(series):]), 64)
		}
	}
	return 0, sc.Err()
}

// health returns p's serving status for svc (UNKNOWN when the check fails).
func health(t *testing.T, p *proc, svc string) healthpb.HealthCheckResponse_ServingStatus {
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	r, err := healthpb.NewHealthClient(p.conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return r.GetStatus()
}

var (
	sidecarSvc = kvcv1.SidecarService_ServiceDesc.ServiceName
	routerSvc  = kvcv1.RouterService_ServiceDesc.ServiceName
)

// recvCmd is a command as a sidecar received it.
type recvCmd struct {
	via    string // which stream (the replica's node id)
	epoch  int64
	id     uint64
	maxNow int64 // the highest epoch the sidecar had seen when it arrived
	at     time.Time
}

// epochWatch is one sidecar's view of epochs across all its streams, as pkg/sidecar keeps it:
// the highest epoch seen (welcomes and commands) and every command received. A command with
// an epoch below the highest seen before it is stale: a real sidecar refuses it, and the
// tests require that none is ever sent.
type epochWatch struct {
	mu   sync.Mutex
	max  int64
	cmds []recvCmd
}

func (w *epochWatch) see(e int64) {
	w.mu.Lock()
	w.max = max(w.max, e)
	w.mu.Unlock()
}

func (w *epochWatch) command(via string, c *kvcv1.Command) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cmds = append(w.cmds, recvCmd{via: via, epoch: c.GetEpoch(), id: c.GetCommandId(), maxNow: w.max, at: time.Now()})
	w.max = max(w.max, c.GetEpoch())
}

// stale returns the commands that arrived with an epoch below one already seen.
func (w *epochWatch) stale() []recvCmd {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []recvCmd
	for _, c := range w.cmds {
		if c.epoch < c.maxNow {
			out = append(out, c)
		}
	}
	return out
}

// commands returns every command received on via.
func (w *epochWatch) commands(via string) []recvCmd {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []recvCmd
	for _, c := range w.cmds {
		if c.via == via {
			out = append(out, c)
		}
	}
	return out
}

// read records every command on st until the stream ends; the channel then yields the error.
func (w *epochWatch) read(via string, st grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse]) <-chan error {
	done := make(chan error, 1)
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				done <- err
				return
			}
			if c := m.GetCommand(); c != nil {
				w.command(via, c)
			}
		}
	}()
	return done
}

// waitErr waits for a stream's end (bounded).
func waitErr(t *testing.T, what string, ch <-chan error, limit time.Duration) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(limit):
		t.Fatalf("timed out after %s waiting for %s", limit, what)
	}
	return nil
}

// router is a gateway's Route stream to one replica; answers are read in the background.
type router struct {
	st   grpc.BidiStreamingClient[kvcv1.RouteRequest, kvcv1.RouteResponse]
	resp chan *kvcv1.RouteResponse
	end  chan error
}

func openRouter(t *testing.T, conn *grpc.ClientConn) *router {
	t.Helper()
	st, err := kvcv1.NewRouterServiceClient(conn).Route(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r := &router{st: st, resp: make(chan *kvcv1.RouteResponse, 16), end: make(chan error, 1)}
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				r.end <- err
				return
			}
			r.resp <- m
		}
	}()
	return r
}

func (r *router) query(t *testing.T, id, session string, turn int32, input int64) {
	t.Helper()
	err := r.st.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: id, SessionId: session, Turn: turn, InputTokens: input, MaxOutputTokens: 64, MultiturnHint: true,
	}}})
	if err != nil && !errors.Is(err, io.EOF) { // EOF: the server ended the stream; next reports why
		t.Fatalf("route send: %v", err)
	}
}

// next returns the next answer, or the stream's end (resp nil).
func (r *router) next(t *testing.T, limit time.Duration) (*kvcv1.RouteResponse, error) {
	t.Helper()
	select {
	case m := <-r.resp:
		return m, nil
	case err := <-r.end:
		r.end <- err
		return nil, err
	case <-time.After(limit):
		t.Fatalf("no route answer within %s", limit)
	}
	return nil, nil
}

func describe(c recvCmd) string {
	return fmt.Sprintf("command %d epoch %d via %s after epoch %d was seen", c.id, c.epoch, c.via, c.maxNow)
}

// quiesce waits until p has nothing queued for etcd and its count of acked Txns has not
// moved for 10 polls (about 200 ms, ten flush delays), and returns that count.
func quiesce(t *testing.T, p *proc) float64 {
	t.Helper()
	const okTxns = `kvc_kvstore_txns_total{result="ok"}`
	last, same := -1.0, 0
	waitFor(t, p.node+" quiet", 10*time.Second, func() bool {
		ok := metric(t, p, okTxns)
		if ok == last && metric(t, p, "kvc_kvstore_pending_ops") == 0 {
			same++
		} else {
			last, same = ok, 0
		}
		return same >= 10
	})
	return last
}

// watchDelete watches the election prefix for the delete of the key created at revision
// epoch and yields the revision of that delete.
func watchDelete(t *testing.T, cli *clientv3.Client, electionPrefix string, epoch int64) <-chan int64 {
	t.Helper()
	resp, err := cli.Get(t.Context(), electionPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var key string
	for _, kv := range resp.Kvs {
		if kv.CreateRevision == epoch {
			key = string(kv.Key)
		}
	}
	if key == "" {
		t.Fatalf("no election key created at %d", epoch)
	}
	out := make(chan int64, 1)
	wch := cli.Watch(t.Context(), key, clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		for wr := range wch {
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					out <- ev.Kv.ModRevision
					return
				}
			}
		}
	}()
	return out
}
