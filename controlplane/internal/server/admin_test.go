package server

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvstore"
)

// TestEtcdErrCodes pins the codes of store errors (issue 16 findings 3 and 5): retryable
// UNAVAILABLE for an etcd that does not answer, permanent RESOURCE_EXHAUSTED for values or a
// database over etcd's limits, and the caller's own code when its context ended.
func TestEtcdErrCodes(t *testing.T) {
	live := context.Background()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithTimeout(context.Background(), 0)
	defer cancel2()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want codes.Code
	}{
		{"no answer within the call timeout", live, fmt.Errorf("kvstore: get k: %w: no answer within 2s: %w", kvstore.ErrUnavailable, context.DeadlineExceeded), codes.Unavailable},
		{"connection error", live, errors.New("etcdserver: no leader"), codes.Unavailable},
		{"too large", live, fmt.Errorf("kvstore: txn: %w: request is too large", kvstore.ErrTooLarge), codes.ResourceExhausted},
		{"quota", live, fmt.Errorf("kvstore: txn: %w", kvstore.ErrNoSpace), codes.ResourceExhausted},
		{"caller cancelled", cancelled, context.Canceled, codes.Canceled},
		{"caller deadline", expired, context.DeadlineExceeded, codes.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := status.Code(etcdErr(tc.ctx, tc.err)); got != tc.want {
				t.Fatalf("code %v, want %v", got, tc.want)
			}
		})
	}
}
