package server

import (
	"context"
	"errors"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultHelloTimeout bounds the wait for a stream's first message.
const DefaultHelloTimeout = 10 * time.Second

// Sidecar implements kvc.v1.SidecarService.
type Sidecar struct {
	kvcv1.UnimplementedSidecarServiceServer
	NodeID       string
	Addr         string // advertised address, sent in the welcome
	State        *state.State
	Log          zerolog.Logger
	HelloTimeout time.Duration
	// OnStale is called when a hello shows a newer epoch than ours (this leader is stale).
	OnStale func()

	metrics *sidecarMetrics
}

type sidecarMetrics struct {
	rejected *prometheus.CounterVec
	messages *prometheus.CounterVec
	streams  prometheus.Gauge
}

// NewSidecar returns the service with its metrics registered on reg (may be nil).
func NewSidecar(s Sidecar, reg prometheus.Registerer) *Sidecar {
	m := &sidecarMetrics{
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_stream_messages_rejected_total", Help: "Sidecar stream messages rejected, by reason.",
		}, []string{"reason"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_stream_messages_total", Help: "Sidecar stream messages received, by type.",
		}, []string{"type"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_sidecar_streams", Help: "Live sidecar streams on this replica.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.rejected, m.messages, m.streams)
	}
	if s.HelloTimeout <= 0 {
		s.HelloTimeout = DefaultHelloTimeout
	}
	s.metrics = m
	return &s
}

type recvResult struct {
	msg *kvcv1.ConnectRequest
	err error
}

// Connect serves one sidecar stream.
func (s *Sidecar) Connect(stream grpc.BidiStreamingServer[kvcv1.ConnectRequest, kvcv1.ConnectResponse]) error {
	ctx := stream.Context()
	in := make(chan recvResult)
	go func() {
		for {
			m, err := stream.Recv()
			select {
			case in <- recvResult{m, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()

	// Hello first.
	timer := time.NewTimer(s.HelloTimeout)
	defer timer.Stop()
	var first recvResult
	select {
	case first = <-in:
	case <-timer.C:
		s.reject("hello_timeout")
		return status.Errorf(codes.DeadlineExceeded, "no hello within %s", s.HelloTimeout)
	case <-ctx.Done():
		return status.Error(codes.Unavailable, "stream ended before hello")
	}
	if first.err != nil {
		return recvErr(first.err)
	}
	h := first.msg.GetHello()
	if h == nil {
		s.reject("hello_not_first")
		return status.Error(codes.FailedPrecondition, "the first message on a Connect stream must be hello")
	}
	if err := validateHello(h); err != nil {
		s.reject("invalid_hello")
		return status.Errorf(codes.InvalidArgument, "hello: %v", err)
	}
	// Under mTLS the sidecar's certificate must name the worker it registers as (nil in
	// plaintext mode).
	if err := tlsx.PeerAllowsWorker(ctx, h.GetWorkerId()); err != nil {
		s.reject("worker_not_in_certificate")
		s.Log.Warn().Str("worker", h.GetWorkerId()).Str("reason", status.Convert(err).Message()).Msg("hello refused")
		return err
	}
	st, err := s.State.Attach(h)
	var tpErr *state.TPError
	switch {
	case err == nil:
	case errors.As(err, &tpErr):
		// A rank that disagrees with its connected group (tensor parallelism): a stable code
		// and a TPError detail; the sidecar logs the message and retries with backoff.
		s.reject(tpErr.Reason())
		s.Log.Warn().Str("worker", h.GetWorkerId()).Str("tp_group", h.GetTpGroup()).Int32("tp_rank", h.GetTpRank()).
			Int32("tp_size", h.GetTpSize()).Str("reason", tpErr.Reason()).Str("conflicts_with", tpErr.Detail.GetConflictingWorkerId()).
			Msg("hello refused: " + tpErr.Error())
		code := codes.FailedPrecondition
		if tpErr.Detail.GetReason() == kvcv1.TPErrorReason_TP_ERROR_REASON_RANK_TAKEN {
			code = codes.AlreadyExists
		}
		st := status.New(code, tpErr.Error())
		if d, derr := st.WithDetails(tpErr.Detail); derr == nil {
			st = d
		}
		return st.Err()
	case errors.Is(err, state.ErrDuplicate):
		s.reject("duplicate_worker")
		return status.Errorf(codes.AlreadyExists, "worker %q already has a live stream", h.GetWorkerId())
	case errors.Is(err, state.ErrStaleLeader):
		s.reject("stale_leader")
		s.Log.Warn().Str("worker", h.GetWorkerId()).Int64("seen", h.GetLastEpochSeen()).Int64("ours", s.State.Epoch()).
			Msg("sidecar has seen a newer epoch: stepping down")
		if s.OnStale != nil {
			s.OnStale()
		}
		return status.Errorf(codes.Unavailable, "stale leader: worker has seen epoch %d, ours is %d", h.GetLastEpochSeen(), s.State.Epoch())
	case errors.Is(err, state.ErrNotLeader):
		return status.Error(codes.Unavailable, "not the leader")
	default:
		return status.Errorf(codes.Internal, "attach: %v", err)
	}
	s.metrics.streams.Inc()
	defer s.metrics.streams.Dec()
	defer s.State.Detach(st)
	log := s.Log.With().Str("worker", h.GetWorkerId()).Logger()

	welcome := &kvcv1.ConnectResponse{Msg: &kvcv1.ConnectResponse_Welcome{Welcome: &kvcv1.Welcome{
		Epoch: s.State.Epoch(), LeaderId: s.NodeID, LeaderAddr: s.Addr, Policy: s.State.Policy(),
	}}}
	if err := stream.Send(welcome); err != nil {
		return err
	}

	sctx, scancel := context.WithCancel(ctx)
	sendErr := make(chan error, 1)
	go func() { sendErr <- sendLoop(sctx, stream, st) }()
	defer func() {
		scancel()
		<-sendErr
	}()

	for {
		select {
		case r := <-in:
			if r.err != nil {
				return recvErr(r.err)
			}
			if err := s.handle(st, r.msg, log); err != nil {
				return err
			}
		case err := <-sendErr:
			sendErr <- err // for the deferred wait
			if err == nil {
				return status.Error(codes.Unavailable, "stream closed")
			}
			return err
		case <-st.Done():
			return status.Error(codes.Unavailable, "leadership ended; reconnect to the new leader")
		case <-ctx.Done():
			return status.Error(codes.Unavailable, "leadership ended or server stopping; reconnect")
		}
	}
}

func sendLoop(ctx context.Context, stream grpc.BidiStreamingServer[kvcv1.ConnectRequest, kvcv1.ConnectResponse], st *state.Stream) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-st.Queue():
			if err := stream.Send(m); err != nil {
				return err
			}
		}
	}
}

func recvErr(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

func (s *Sidecar) reject(reason string) { s.metrics.rejected.WithLabelValues(reason).Inc() }

// refusedClaim is the status that ends the stream of a sidecar whose report claimed a KV
// generation the control plane never issued (state.ClaimError; nothing of the report was
// applied, the state counted and logged it): OUT_OF_RANGE for a generation above the highest
// issued, PERMISSION_DENIED for a session its worker was never given. nil for other errors.
// A sidecar that keeps sending such a report never gets its worker back into routing.
func (s *Sidecar) refusedClaim(err error) error {
	var ce *state.ClaimError
	if !errors.As(err, &ce) {
		return nil
	}
	if ce.AboveIssued() {
		s.reject("generation_above_issued")
		return status.Error(codes.OutOfRange, ce.Error())
	}
	s.reject("generation_not_given")
	return status.Error(codes.PermissionDenied, ce.Error())
}

// handle applies one message. A bad message is logged, counted and dropped; only a protocol
// violation (a second hello) or a claim of a generation never issued (refusedClaim) ends the
// stream.
func (s *Sidecar) handle(st *state.Stream, m *kvcv1.ConnectRequest, log zerolog.Logger) error {
	bad := func(reason string, err error) error {
		s.reject(reason)
		log.Warn().Str("reason", reason).Err(err).Msg("sidecar message rejected")
		return nil
	}
	switch msg := m.GetMsg().(type) {
	case *kvcv1.ConnectRequest_Hello:
		s.reject("second_hello")
		return status.Error(codes.FailedPrecondition, "hello already received on this stream")
	case *kvcv1.ConnectRequest_Load:
		s.metrics.messages.WithLabelValues("load").Inc()
		if err := validateLoad(msg.Load.GetLoad()); err != nil {
			return bad("invalid_load", err)
		}
		if err := s.State.ApplyLoad(st, msg.Load.GetLoad()); err != nil {
			return bad("stale_stream", err)
		}
	case *kvcv1.ConnectRequest_ResidentSessions:
		s.metrics.messages.WithLabelValues("resident_sessions").Inc()
		if reason, err := validateResident(st.Role, msg.ResidentSessions); err != nil {
			return bad(reason, err)
		}
		if err := s.State.Reconcile(st, msg.ResidentSessions); err != nil {
			if cerr := s.refusedClaim(err); cerr != nil {
				return cerr
			}
			return bad("stale_stream", err)
		}
		// A restarted decode sidecar lists its re-committed sessions without snapshot targets
		// (they lived in its memory): name them again, so they push D→P snapshots.
		if n, err := s.State.ResendTargets(st, msg.ResidentSessions); err != nil {
			log.Warn().Err(err).Str("worker", st.WorkerID).Int("sent", n).Msg("snapshot targets not all re-sent after a resync")
		}
	case *kvcv1.ConnectRequest_SessionEvent:
		s.metrics.messages.WithLabelValues("session_event").Inc()
		if reason, err := validateEvent(st.Role, msg.SessionEvent); err != nil {
			return bad(reason, err)
		}
		if err := s.State.ApplyEvent(st, msg.SessionEvent); err != nil {
			if cerr := s.refusedClaim(err); cerr != nil {
				return cerr
			}
			return bad("stale_stream", err)
		}
	case *kvcv1.ConnectRequest_Ack:
		s.metrics.messages.WithLabelValues("ack").Inc()
		if !s.State.Ack(st, msg.Ack) {
			return bad("unknown_ack", errors.New("ack of a command this stream was not sent"))
		}
	default:
		return bad("empty_message", errors.New("message with no content"))
	}
	return nil
}
