package kvxfer

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestTypedPeerError(t *testing.T) {
	all := []error{ErrBaseMismatch, ErrGenerationStale, ErrIngestBusy, ErrCreditRefused, ErrStoreFull, ErrSnapshotChanged}
	tests := []struct {
		name string
		err  error
		want error // nil: none of the reasons
		code codes.Code
	}{
		{"base mismatch", PeerStatus(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH, StoredSeqlen: 7}, "x"), ErrBaseMismatch, codes.FailedPrecondition},
		{"stale, wrapped", fmt.Errorf("reserve: %w", PeerStatus(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_GENERATION_STALE}, "x")), ErrGenerationStale, codes.FailedPrecondition},
		{"busy", PeerStatus(codes.Aborted, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_INGEST_BUSY}, "x"), ErrIngestBusy, codes.Aborted},
		{"credit", PeerStatus(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_CREDIT_REFUSED}, "x"), ErrCreditRefused, codes.FailedPrecondition},
		{"full", PeerStatus(codes.ResourceExhausted, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_STORE_FULL}, "x"), ErrStoreFull, codes.ResourceExhausted},
		{"changed", PeerStatus(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_SNAPSHOT_CHANGED}, "x"), ErrSnapshotChanged, codes.FailedPrecondition},
		// the old text without a detail is no base mismatch: nothing is read from messages
		{"text only", status.Error(codes.FailedPrecondition, "base_len 8 does not match the stored seqlen 0 of generation 1"), nil, codes.FailedPrecondition},
		{"unspecified detail", PeerStatus(codes.Internal, &kvcv1.PeerError{}, "x"), nil, codes.Internal},
		{"plain error", errors.New("boom"), nil, codes.Unknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := TypedPeerError(tc.err)
			for _, r := range all {
				if errors.Is(got, r) != (r == tc.want) {
					t.Errorf("errors.Is(%v, %v) = %v", got, r, !(r == tc.want))
				}
			}
			if c := status.Code(got); c != tc.code {
				t.Errorf("code %v, want %v", c, tc.code)
			}
			if TypedPeerError(got) != got {
				t.Error("typing twice changed the error")
			}
			var pe *PeerError
			if errors.As(got, &pe) != (tc.want != nil || tc.name == "unspecified detail") {
				t.Errorf("errors.As *PeerError = %v", !(tc.want != nil))
			}
		})
	}
	if TypedPeerError(nil) != nil {
		t.Fatal("nil typed is not nil")
	}
	var pe *PeerError
	if !errors.As(TypedPeerError(tests[0].err), &pe) || pe.Detail.GetStoredSeqlen() != 7 || pe.Reason() != kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH {
		t.Fatalf("detail lost: %+v", pe)
	}
}

// FuzzTypedPeerError: a status read off the wire (any code, message and detail — a type URL and
// bytes, valid or not) never panics the decoder, and it types an error only around a PeerError.
func FuzzTypedPeerError(f *testing.F) {
	good, _ := proto.Marshal(&kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH, StoredSeqlen: 3})
	f.Add(uint32(9), "m", "type.googleapis.com/kvc.v1.PeerError", good)
	f.Add(uint32(10), "busy", "type.googleapis.com/kvc.v1.PeerError", []byte{0x08, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add(uint32(2), "x", "type.googleapis.com/google.protobuf.Duration", []byte{0x08, 0x01})
	f.Add(uint32(13), "", "", []byte{0xff})
	f.Fuzz(func(t *testing.T, code uint32, msg, typeURL string, value []byte) {
		sp := status.New(codes.Code(code%17), msg).Proto()
		sp.Details = append(sp.Details, &anypb.Any{TypeUrl: typeURL, Value: value})
		err := status.ErrorProto(sp)
		got := TypedPeerError(err)
		var pe *PeerError
		if errors.As(got, &pe) {
			if pe.Detail == nil || status.Code(got) != status.Code(err) {
				t.Fatalf("typed %v from %v", got, err)
			}
		} else if got != err {
			t.Fatalf("untyped error changed: %v -> %v", err, got)
		}
	})
}
