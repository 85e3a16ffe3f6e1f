package cpclient

import (
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// DialCredentials is the transport-credentials dial option of every client of the control
// plane: mutual TLS with src requiring the server's certificate role to be controlplane, or
// plaintext when src is nil. Append it after grpcx.ClientOptions().
func DialCredentials(src *tlsx.Source) grpc.DialOption {
	return grpc.WithTransportCredentials(grpcx.Credentials(src, tlsx.RoleControlPlane))
}
