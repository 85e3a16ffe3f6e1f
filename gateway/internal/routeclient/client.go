package routeclient

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// ErrUnavailable means no decision could be had in time (no stream, stream broke, or the
// route timeout passed): the caller fails open.
var ErrUnavailable = errors.New("control plane unavailable")

// RejectedError is a RouteError the control plane answered for a query (bad input, for example).
type RejectedError struct {
	Code    codes.Code
	Message string
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("control plane rejected the query (%s): %s", e.Code, e.Message)
}

// Observer receives connection events (metrics); any field may be nil.
type Observer struct {
	Connected func(addr string, up bool)
	Orphan    func()            // a decision arrived for a query nobody waits for any more
	Silent    func(addr string) // the stream's control plane answered nothing for half the lease and was left
}

// Client is the gateway's Route stream.
type Client struct {
	eps     *cpclient.Endpoints
	timeout time.Duration
	log     zerolog.Logger
	obs     Observer
	dial    []grpc.DialOption
	live    cpclient.Liveness

	seq atomic.Uint64

	mu        sync.Mutex
	cur       *conn
	waiters   map[string]chan result
	upCh      chan struct{} // closed when a stream comes up; replaced when it goes down
	downSince time.Time
}

type conn struct {
	addr   string
	stream grpc.BidiStreamingClient[kvcv1.RouteRequest, kvcv1.RouteResponse]
	sendMu sync.Mutex
}

type result struct {
	dec *kvcv1.RouteDecision
	err error
}

// New returns a client for the control-plane addresses; routeTimeout bounds each Decide. dial
// are extra dial options (transport credentials: grpcx.DialOptions); none is plaintext.
func New(addrs []string, routeTimeout time.Duration, log zerolog.Logger, obs Observer, dial ...grpc.DialOption) *Client {
	return &Client{
		dial:      dial,
		live:      cpclient.LivenessFor(0),
		eps:       cpclient.NewEndpoints(addrs),
		timeout:   routeTimeout,
		log:       log,
		obs:       obs,
		waiters:   map[string]chan result{},
		upCh:      make(chan struct{}),
		downSince: time.Now(),
	}
}

// SetLease tunes the stream's liveness watch to the control planes' election TTL (before Run):
// a control plane that answers nothing for half of it (paused, its link frozen) is left for
// the next endpoint, and queries waiting on it fail over at once (cpclient.Liveness).
func (c *Client) SetLease(lease time.Duration) { c.live = cpclient.LivenessFor(lease) }

// Connected reports whether a Route stream is up now.
func (c *Client) Connected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cur != nil
}

// Run keeps a stream open until ctx ends, following the leader (cpclient.Follow).
func (c *Client) Run(ctx context.Context) error {
	// The default ceiling: reach a new leader within ~0.4 s of its election (issue 16 finding 3).
	return cpclient.Follow(ctx, c.eps, c.session, cpclient.WithBackoff(50*time.Millisecond, 0),
		cpclient.WithLogger(c.log, "route stream down"),
		cpclient.OnSilent(func(addr string) {
			if c.obs.Silent != nil {
				c.obs.Silent(addr)
			}
		}))
}

// session runs one stream; it reports whether the stream answered anything.
func (c *Client) session(ctx context.Context, addr string) (served bool, err error) {
	opts := append(grpcx.DialOptions(nil), c.dial...) // later credentials win over the plaintext default
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return false, err
	}
	defer cc.Close()
	wctx, stopWatch := c.live.Guard(ctx, cc)
	defer func() {
		if serr := stopWatch(); serr != nil {
			err = serr
		}
	}()
	sctx, cancel := context.WithCancel(wctx)
	defer cancel()
	stream, err := kvcv1.NewRouterServiceClient(cc).Route(sctx)
	if err != nil {
		return false, err
	}
	cn := &conn{addr: addr, stream: stream}
	c.mu.Lock()
	c.cur = cn
	close(c.upCh)
	c.mu.Unlock()
	if c.obs.Connected != nil {
		c.obs.Connected(addr, true)
	}
	defer func() {
		c.mu.Lock()
		if c.cur == cn {
			c.cur = nil
			c.upCh = make(chan struct{})
			c.downSince = time.Now()
		}
		// Everyone waiting on this stream fails over now instead of at the route timeout.
		for id, w := range c.waiters {
			select {
			case w <- result{err: ErrUnavailable}:
			default:
			}
			delete(c.waiters, id)
		}
		c.mu.Unlock()
		if c.obs.Connected != nil {
			c.obs.Connected(addr, false)
		}
	}()
	for {
		resp, rerr := stream.Recv()
		if rerr != nil {
			return served, rerr
		}
		served = true
		c.dispatch(cn, resp)
	}
}

func (c *Client) dispatch(cn *conn, resp *kvcv1.RouteResponse) {
	switch k := resp.GetKind().(type) {
	case *kvcv1.RouteResponse_Decision:
		d := k.Decision
		if !c.deliver(d.GetRequestId(), result{dec: d}) {
			// Nobody waits (route timeout passed): release the reservation right away.
			if c.obs.Orphan != nil {
				c.obs.Orphan()
			}
			_ = c.send(cn, &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
				DecisionId: d.GetDecisionId(), ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, NoAck: true,
				Detail: "gateway stopped waiting for this decision (route timeout)", ExecutedMode: d.GetMode(),
			}}})
		}
	case *kvcv1.RouteResponse_Error:
		e := k.Error
		if e.GetRequestId() != "" {
			c.deliver(e.GetRequestId(), result{err: &RejectedError{Code: codes.Code(e.GetCode()), Message: e.GetMessage()}})
			return
		}
		c.log.Debug().Str("decision_id", e.GetDecisionId()).Int32("code", e.GetCode()).Str("msg", e.GetMessage()).Msg("route error for outcome")
	case *kvcv1.RouteResponse_OutcomeAck:
	}
}

func (c *Client) deliver(id string, r result) bool {
	c.mu.Lock()
	w, ok := c.waiters[id]
	delete(c.waiters, id)
	c.mu.Unlock()
	if ok {
		w <- r // buffered 1, sole sender after delete
	}
	return ok
}

func (c *Client) send(cn *conn, req *kvcv1.RouteRequest) error {
	cn.sendMu.Lock()
	defer cn.sendMu.Unlock()
	return cn.stream.Send(req)
}

// Decide asks for a decision for q (request_id is filled in). It returns ErrUnavailable when no
// stream is up or no answer came within the route timeout, and a *RejectedError when the
// control plane refused the query.
func (c *Client) Decide(ctx context.Context, q *kvcv1.RouteQuery) (*kvcv1.RouteDecision, error) {
	id := "g" + strconv.FormatUint(c.seq.Add(1), 36) + "-" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	q.RequestId = id
	w := make(chan result, 1)
	deadline := time.Now().Add(c.timeout)
	c.mu.Lock()
	cn := c.cur
	for cn == nil {
		// A stream that went down less than a route timeout ago (or is starting) may come back
		// within this request's budget; one that has been down longer means fail open now.
		up, since := c.upCh, c.downSince
		c.mu.Unlock()
		wait := time.Until(deadline)
		if time.Since(since) > c.timeout || wait <= 0 {
			return nil, ErrUnavailable
		}
		t := time.NewTimer(wait)
		select {
		case <-up:
			t.Stop()
		case <-t.C:
			return nil, ErrUnavailable
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		c.mu.Lock()
		cn = c.cur
	}
	c.waiters[id] = w
	c.mu.Unlock()
	drop := func() {
		c.mu.Lock()
		delete(c.waiters, id)
		c.mu.Unlock()
	}
	if err := c.send(cn, &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: q}}); err != nil {
		drop()
		return nil, fmt.Errorf("%w: send: %v", ErrUnavailable, err)
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case r := <-w:
		return r.dec, r.err
	case <-t.C:
		drop()
		return nil, fmt.Errorf("%w: no decision within %v", ErrUnavailable, c.timeout)
	case <-ctx.Done():
		drop()
		return nil, ctx.Err()
	}
}

// Report sends an outcome on the current stream (best effort: a lost outcome is released by the
// control plane's reservation timeout). It marks o no_ack: the client acts on no acknowledgement,
// so the control plane sends none (an outcome it refuses is still answered, and logged).
func (c *Client) Report(o *kvcv1.RouteOutcome) error {
	o.NoAck = true
	c.mu.Lock()
	cn := c.cur
	c.mu.Unlock()
	if cn == nil {
		return ErrUnavailable
	}
	return c.send(cn, &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: o}})
}
