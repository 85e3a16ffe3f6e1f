// Package cptest is a scriptable control plane for sidecar tests: a real gRPC SidecarService on
// a loopback port that records hellos, resyncs, loads, session events and acks, and lets the test
// send commands or play a standby (UNAVAILABLE with a leader hint). It is the test's stand-in for
// the leader, the way the test plays the SGLang workers; it makes no routing decisions.
package cptest

import (
	"context"
	"fmt"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Event is a session event with the worker that sent it.
type Event struct {
	Worker string
	Ev     *kvcv1.SessionEvent
}

// Msg is one message received on a worker's stream, in arrival order: its type ("hello",
// "resync", "load", "event", "ack"), the connection it came on (1 = first) and, for an event,
// the event.
type Msg struct {
	Conn int
	Type string
	Ev   *kvcv1.SessionEvent
}

// Server is the scripted control plane.
type Server struct {
	kvcv1.UnimplementedSidecarServiceServer
	Addr string

	srv *grpc.Server

	mu      sync.Mutex
	changed chan struct{}
	epoch   int64
	policy  *kvcv1.Policy
	standby *kvcv1.LeaderHint
	nextID  uint64
	streams map[string]chan *kvcv1.Command
	hellos  map[string]*kvcv1.Hello
	resyncs map[string]*kvcv1.ResidentSessions
	loads   map[string]*kvcv1.WorkerLoad
	events  []Event
	acks    map[uint64]*kvcv1.CommandAck
	conns   map[string]int
	msgs    map[string][]Msg
	refused int
	kick    chan struct{}
}

// Start serves on 127.0.0.1:0 with a leader epoch and the policy sent in welcomes.
func Start(epoch int64, policy *kvcv1.Policy) (*Server, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{Addr: lis.Addr().String(), srv: grpc.NewServer(), changed: make(chan struct{}), epoch: epoch, policy: policy,
		streams: map[string]chan *kvcv1.Command{}, hellos: map[string]*kvcv1.Hello{}, resyncs: map[string]*kvcv1.ResidentSessions{},
		loads: map[string]*kvcv1.WorkerLoad{}, acks: map[uint64]*kvcv1.CommandAck{}, conns: map[string]int{}, msgs: map[string][]Msg{}, kick: make(chan struct{})}
	kvcv1.RegisterSidecarServiceServer(s.srv, s)
	go func() { _ = s.srv.Serve(lis) }()
	return s, nil
}

// Close stops the server, cutting every stream.
func (s *Server) Close() { s.srv.Stop() }

func (s *Server) bumpLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// SetStandby makes new Connect calls fail with UNAVAILABLE and this hint (nil: serve again).
func (s *Server) SetStandby(h *kvcv1.LeaderHint) {
	s.mu.Lock()
	s.standby = h
	s.mu.Unlock()
}

// Kick cuts every open stream (the sidecars reconnect).
func (s *Server) Kick() {
	s.mu.Lock()
	close(s.kick)
	s.kick = make(chan struct{})
	s.mu.Unlock()
}

// SetEpoch changes the epoch of later welcomes and commands.
func (s *Server) SetEpoch(e int64) {
	s.mu.Lock()
	s.epoch = e
	s.mu.Unlock()
}

// Connect implements SidecarService.
func (s *Server) Connect(stream grpc.BidiStreamingServer[kvcv1.ConnectRequest, kvcv1.ConnectResponse]) error {
	s.mu.Lock()
	if s.standby != nil {
		h := s.standby
		s.refused++
		s.bumpLocked()
		s.mu.Unlock()
		return cpclient.NotLeaderError(h)
	}
	s.mu.Unlock()
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h := first.GetHello()
	if h == nil || h.GetWorkerId() == "" {
		return status.Error(codes.InvalidArgument, "hello first")
	}
	id := h.GetWorkerId()
	cmds := make(chan *kvcv1.Command, 1024)
	s.mu.Lock()
	s.hellos[id] = h
	delete(s.resyncs, id) // the resync of this connection follows
	s.streams[id] = cmds
	s.conns[id]++
	conn := s.conns[id]
	s.msgs[id] = append(s.msgs[id], Msg{Conn: conn, Type: "hello"})
	ep, pol, kick := s.epoch, s.policy, s.kick
	s.bumpLocked()
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		if s.streams[id] == cmds {
			delete(s.streams, id)
		}
		s.bumpLocked()
		s.mu.Unlock()
	}()
	if err := stream.Send(&kvcv1.ConnectResponse{Msg: &kvcv1.ConnectResponse_Welcome{Welcome: &kvcv1.Welcome{Epoch: ep, LeaderId: "cptest", Policy: pol}}}); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				errc <- err
				return
			}
			s.mu.Lock()
			switch x := m.GetMsg().(type) {
			case *kvcv1.ConnectRequest_ResidentSessions:
				s.resyncs[id] = x.ResidentSessions
				s.msgs[id] = append(s.msgs[id], Msg{Conn: conn, Type: "resync"})
			case *kvcv1.ConnectRequest_Load:
				s.loads[id] = x.Load.GetLoad()
				s.msgs[id] = append(s.msgs[id], Msg{Conn: conn, Type: "load"})
			case *kvcv1.ConnectRequest_SessionEvent:
				s.events = append(s.events, Event{Worker: id, Ev: x.SessionEvent})
				s.msgs[id] = append(s.msgs[id], Msg{Conn: conn, Type: "event", Ev: x.SessionEvent})
			case *kvcv1.ConnectRequest_Ack:
				s.acks[x.Ack.GetCommandId()] = x.Ack
				s.msgs[id] = append(s.msgs[id], Msg{Conn: conn, Type: "ack"})
			}
			s.bumpLocked()
			s.mu.Unlock()
		}
	}()
	for {
		select {
		case err := <-errc:
			return err
		case <-kick:
			return status.Error(codes.Unavailable, "cptest: stream cut")
		case c := <-cmds:
			if err := stream.Send(&kvcv1.ConnectResponse{Msg: &kvcv1.ConnectResponse_Command{Command: c}}); err != nil {
				return err
			}
		}
	}
}

// Send queues a command to a connected worker (command_id and, when zero, epoch are filled in)
// and returns its id.
func (s *Server) Send(worker string, cmd *kvcv1.Command) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch, ok := s.streams[worker]
	if !ok {
		return 0, fmt.Errorf("cptest: %s not connected", worker)
	}
	if cmd.CommandId == 0 {
		s.nextID++
		cmd.CommandId = s.nextID
	}
	if cmd.Epoch == 0 {
		cmd.Epoch = s.epoch
	}
	ch <- cmd
	return cmd.CommandId, nil
}

// Wait blocks until cond (called under the lock with the server) holds or ctx ends.
func (s *Server) Wait(ctx context.Context, cond func(v *View) bool) error {
	for {
		s.mu.Lock()
		ok := cond(&View{s})
		ch := s.changed
		s.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cptest: condition not met: %w", ctx.Err())
		case <-ch:
		}
	}
}

// View gives Wait conditions read access to the recorded state.
type View struct{ s *Server }

// Connected reports whether worker has a live stream.
func (v *View) Connected(worker string) bool { _, ok := v.s.streams[worker]; return ok }

// Connects counts the worker's connections so far.
func (v *View) Connects(worker string) int { return v.s.conns[worker] }

// Hello returns the worker's last hello.
func (v *View) Hello(worker string) *kvcv1.Hello { return v.s.hellos[worker] }

// Resync returns the worker's last full resync.
func (v *View) Resync(worker string) *kvcv1.ResidentSessions { return v.s.resyncs[worker] }

// Load returns the worker's last load report.
func (v *View) Load(worker string) *kvcv1.WorkerLoad { return v.s.loads[worker] }

// Ack returns the ack of a command.
func (v *View) Ack(id uint64) *kvcv1.CommandAck { return v.s.acks[id] }

// Refused counts Connect calls refused as a standby.
func (v *View) Refused() int { return v.s.refused }

// Messages returns every message the worker sent so far, in arrival order.
func (v *View) Messages(worker string) []Msg { return v.s.msgs[worker] }

// Events returns every event so far.
func (v *View) Events() []Event { return v.s.events }

// FindEvent returns the first event of kind for session.
func (v *View) FindEvent(worker, session string, kind kvcv1.SessionEventKind) *kvcv1.SessionEvent {
	for _, e := range v.s.events {
		if e.Worker == worker && e.Ev.GetSessionId() == session && e.Ev.GetKind() == kind {
			return e.Ev
		}
	}
	return nil
}
