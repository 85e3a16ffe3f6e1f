package kvxfer

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Reasons of refused TransferPeerService calls, for errors.Is on an error passed through
// TypedPeerError. They are compared by the PeerError detail's reason, never by text.
var (
	ErrBaseMismatch     error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH)
	ErrGenerationStale  error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_GENERATION_STALE)
	ErrIngestBusy       error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_INGEST_BUSY)
	ErrCreditRefused    error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_CREDIT_REFUSED)
	ErrStoreFull        error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_STORE_FULL)
	ErrSnapshotChanged  error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_SNAPSHOT_CHANGED)
	errPeerReasonUnspec error = peerReason(kvcv1.PeerErrorReason_PEER_ERROR_REASON_UNSPECIFIED)
)

// peerReason is a PeerErrorReason as an error value (the targets of errors.Is).
type peerReason kvcv1.PeerErrorReason

func (r peerReason) Error() string { return kvcv1.PeerErrorReason(r).String() }

// PeerStatus is the status error of a refused peer call: code and message as usual, plus the
// PeerError detail (d) that the caller's retry decision reads.
func PeerStatus(code codes.Code, d *kvcv1.PeerError, format string, args ...any) error {
	st := status.New(code, fmt.Sprintf(format, args...))
	if ds, err := st.WithDetails(d); err == nil {
		st = ds
	}
	return st.Err()
}

// PeerError is a refused peer call whose status carried a PeerError detail. It unwraps to the
// error as received (status.Code still works) and matches the Err* reasons with errors.Is.
type PeerError struct {
	Detail *kvcv1.PeerError
	err    error
}

func (e *PeerError) Error() string { return e.err.Error() }

// Unwrap returns the error as received.
func (e *PeerError) Unwrap() error { return e.err }

// Is reports whether target is the reason of this refusal.
func (e *PeerError) Is(target error) bool {
	r, ok := target.(peerReason)
	return ok && r != errPeerReasonUnspec && kvcv1.PeerErrorReason(r) == e.Detail.GetReason()
}

// Reason is the refusal's reason.
func (e *PeerError) Reason() kvcv1.PeerErrorReason { return e.Detail.GetReason() }

// TypedPeerError returns err as a *PeerError when its gRPC status (also one wrapped with %w)
// carries a PeerError detail, else err unchanged; nil stays nil.
func TypedPeerError(err error) error {
	if err == nil {
		return nil
	}
	var pe *PeerError
	if errors.As(err, &pe) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	for _, d := range st.Details() {
		if x, ok := d.(*kvcv1.PeerError); ok {
			return &PeerError{Detail: x, err: err}
		}
	}
	return err
}
