package grpcx

import (
	"context"
	"fmt"
	"net"
	"runtime/debug"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/validator"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// Limits shared by servers and clients.
const (
	// ServerMaxRecvMsgSize bounds any single gRPC message a server accepts (4 MiB, grpc-go's
	// own default) unless WithMaxRecvMsgSize says otherwise: larger requests are refused with
	// RESOURCE_EXHAUSTED before they are decoded.
	ServerMaxRecvMsgSize = 4 << 20
	// MaxRecvMsgSize bounds any single gRPC message our clients accept (16 MiB).
	MaxRecvMsgSize = 16 << 20
	// MaxSendMsgSize bounds any single gRPC message we send.
	MaxSendMsgSize = 16 << 20
	// ClientKeepaliveTime is how often our clients ping an idle connection; the server
	// enforcement below allows it.
	ClientKeepaliveTime = 10 * time.Second
	// ClientKeepaliveTimeout is how long a client waits for a ping ack.
	ClientKeepaliveTimeout = 5 * time.Second
	// ServerKeepaliveTime is how long a server waits without reading anything from a client
	// before it pings; with ServerKeepaliveTimeout it bounds how long a half-open connection
	// (a peer gone without FIN or RST) keeps its streams: a sidecar behind a dead link is
	// detached, and its worker marked unreachable, within Time + Timeout (13 s). Override
	// with WithServerOptions(grpc.KeepaliveParams(...)).
	ServerKeepaliveTime = 10 * time.Second
	// ServerKeepaliveTimeout is how long a server waits for a ping ack.
	ServerKeepaliveTimeout = 3 * time.Second
	// StreamWindow and ConnWindow are the HTTP/2 flow-control windows of our servers and
	// clients (a stream's, a connection's), static: with grpc-go's default dynamic windows each
	// side's bandwidth-delay estimator sends a PING, and its peer an ack, about once per round
	// trip of data, and the small default windows call for WINDOW_UPDATEs: on the benchmark's
	// Route stream one frame more per decision each way beside its two DATA frames, to write,
	// read and wake up for (TestStaticFlowControlWindows; docs/routing.md §10). Our
	// messages are control messages (KV bytes never travel over gRPC); a message larger than
	// the window is still received whole (grpc-go widens the window for it).
	StreamWindow = 1 << 20
	ConnWindow   = 4 << 20
)

// Server is a gRPC server with its health service.
type Server struct {
	*grpc.Server
	Health *health.Server
	log    zerolog.Logger
}

// Option adjusts a Server before it is built.
type Option func(*options)

type options struct {
	extra      []grpc.ServerOption
	logCalls   bool
	unaryInts  []grpc.UnaryServerInterceptor
	streamInts []grpc.StreamServerInterceptor
	tls        *tlsx.Source
	maxRecv    int
}

// WithMaxRecvMsgSize sets the largest request message the server accepts (default
// ServerMaxRecvMsgSize).
func WithMaxRecvMsgSize(n int) Option {
	return func(o *options) {
		if n > 0 {
			o.maxRecv = n
		}
	}
}

// WithTLS serves mutual TLS with src (client certificates required and verified against its CA,
// TLS 1.3, files re-read on rotation) and checks every call against tlsx.Table by the caller's
// certificate role: a method not in the table, or a role not allowed for it, is answered
// PERMISSION_DENIED. A nil src keeps the server plaintext (development default).
func WithTLS(src *tlsx.Source) Option { return func(o *options) { o.tls = src } }

// WithServerOptions appends raw grpc.ServerOptions (credentials, for example).
func WithServerOptions(o ...grpc.ServerOption) Option {
	return func(opts *options) { opts.extra = append(opts.extra, o...) }
}

// WithCallLogging logs the start and finish of every call (debug level is used for finish of
// successful calls, so production logs stay quiet).
func WithCallLogging(on bool) Option { return func(o *options) { o.logCalls = on } }

// WithUnaryInterceptors adds interceptors after the standard chain.
func WithUnaryInterceptors(i ...grpc.UnaryServerInterceptor) Option {
	return func(o *options) { o.unaryInts = append(o.unaryInts, i...) }
}

// WithStreamInterceptors adds interceptors after the standard chain.
func WithStreamInterceptors(i ...grpc.StreamServerInterceptor) Option {
	return func(o *options) { o.streamInts = append(o.streamInts, i...) }
}

// NewServer builds the standard server. Register services on it, then call Serve.
func NewServer(log zerolog.Logger, opt ...Option) *Server {
	o := options{logCalls: true, maxRecv: ServerMaxRecvMsgSize}
	for _, f := range opt {
		f(&o)
	}
	codec := newDecodeCodec()
	lg := InterceptorLogger(log)
	logOpts := []logging.Option{logging.WithLogOnEvents(logging.FinishCall)}
	rec := recovery.WithRecoveryHandler(func(p any) error {
		log.Error().Interface("panic", p).Bytes("stack", debug.Stack()).Msg("grpc handler panic")
		return status.Errorf(codes.Internal, "internal error")
	})
	unary := []grpc.UnaryServerInterceptor{recovery.UnaryServerInterceptor(rec), serverMetrics.unaryServer, codec.unary}
	stream := []grpc.StreamServerInterceptor{recovery.StreamServerInterceptor(rec), serverMetrics.streamServer, codec.stream}
	if o.logCalls {
		unary = append(unary, logging.UnaryServerInterceptor(lg, logOpts...))
		stream = append(stream, logging.StreamServerInterceptor(lg, logOpts...))
	}
	if o.tls != nil {
		az := tlsx.NewAuthorizer(log)
		unary = append(unary, az.Unary)
		stream = append(stream, az.Stream)
	}
	unary = append(unary, validator.UnaryServerInterceptor())
	stream = append(stream, validator.StreamServerInterceptor())
	unary = append(unary, o.unaryInts...)
	stream = append(stream, o.streamInts...)

	sopts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(o.maxRecv),
		grpc.MaxSendMsgSize(MaxSendMsgSize),
		grpc.ForceServerCodecV2(codec),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             ClientKeepaliveTime / 2,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:    ServerKeepaliveTime,
			Timeout: ServerKeepaliveTimeout,
		}),
		grpc.StaticStreamWindowSize(StreamWindow),
		grpc.StaticConnWindowSize(ConnWindow),
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
	}
	if o.tls != nil {
		sopts = append(sopts, grpc.Creds(o.tls.ServerCredentials()))
	}
	sopts = append(sopts, serverObserve()...)
	sopts = append(sopts, o.extra...)
	s := grpc.NewServer(sopts...)
	h := health.NewServer()
	healthpb.RegisterHealthServer(s, h)
	reflection.Register(s)
	return &Server{Server: s, Health: h, log: log}
}

// Serve serves on lis until ctx is done, then stops gracefully (bounded by grace, after which
// remaining calls are cut).
func (s *Server) Serve(ctx context.Context, lis net.Listener, grace time.Duration) error {
	serverMetrics.InitializeMetrics(s.Server) // every registered method at 0
	errc := make(chan error, 1)
	go func() { errc <- s.Server.Serve(lis) }()
	select {
	case err := <-errc:
		if err != nil {
			return fmt.Errorf("grpc serve %s: %w", lis.Addr(), err)
		}
		return nil
	case <-ctx.Done():
	}
	s.Health.Shutdown()
	done := make(chan struct{})
	go func() { s.Server.GracefulStop(); close(done) }()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.Server.Stop()
		<-done
	}
	<-errc
	return nil
}

// InterceptorLogger adapts zerolog to go-grpc-middleware's logging.Logger.
func InterceptorLogger(l zerolog.Logger) logging.Logger {
	return logging.LoggerFunc(func(_ context.Context, lvl logging.Level, msg string, fields ...any) {
		ll := l.With().Fields(fields).Logger()
		switch lvl {
		case logging.LevelDebug:
			ll.Debug().Msg(msg)
		case logging.LevelInfo:
			ll.Debug().Msg(msg) // every finished call at info would flood; keep it at debug
		case logging.LevelWarn:
			ll.Warn().Msg(msg)
		case logging.LevelError:
			ll.Error().Msg(msg)
		default:
			ll.Info().Msg(msg)
		}
	})
}

// ClientOptions are the dial options our clients use (keepalive matching the server policy,
// size limits, per-method metrics and trace propagation: observe.go).
func ClientOptions() []grpc.DialOption {
	return append(clientObserve(),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                ClientKeepaliveTime,
			Timeout:             ClientKeepaliveTimeout,
			PermitWithoutStream: true,
		}),
		grpc.WithStaticStreamWindowSize(StreamWindow),
		grpc.WithStaticConnWindowSize(ConnWindow),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(MaxRecvMsgSize),
			grpc.MaxCallSendMsgSize(MaxSendMsgSize),
		),
	)
}

// Credentials are the transport credentials of a client: mutual TLS with src, requiring the
// server's certificate role to be one of server (none given: any role); plaintext when src is
// nil (development default).
func Credentials(src *tlsx.Source, server ...tlsx.Role) credentials.TransportCredentials {
	if src == nil {
		return insecure.NewCredentials()
	}
	return src.ClientCredentials(server...)
}

// DialOptions are ClientOptions plus the transport credentials of Credentials(src, server...):
// what every kvcentric client passes to grpc.NewClient.
func DialOptions(src *tlsx.Source, server ...tlsx.Role) []grpc.DialOption {
	return append(ClientOptions(), grpc.WithTransportCredentials(Credentials(src, server...)))
}
