package tlsx

import (
	"context"
	"crypto/x509"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Rule says who may call one method.
type Rule struct {
	// Roles allowed to call the method.
	Roles []Role
	// AnyPeer allows every peer whose certificate verified against the CA, with or without a
	// role (health checks and reflection).
	AnyPeer bool
	// Note explains the rule (docs).
	Note string
}

var (
	readers  = []Role{RoleOperatorRead, RoleOperatorAdmin}
	anyPeer  = Rule{AnyPeer: true, Note: "any authenticated peer"}
	noTLSUse = Rule{Note: "Unix socket only (plaintext, local worker); never served over TLS"}
)

// Table maps every full gRPC method name served by a kvcentric binary to its rule. A method
// that is not in the table is denied. Tests check it against every method of every service in
// the generated descriptors.
var Table = map[string]Rule{
	// Control plane: sidecars.
	kvcv1.SidecarService_Connect_FullMethodName: {Roles: []Role{RoleSidecar}},
	// Control plane: gateways.
	kvcv1.RouterService_Route_FullMethodName: {Roles: []Role{RoleGateway}},
	// Control plane: operators. The gateway refreshes its fail-open worker lists with ListWorkers.
	kvcv1.AdminService_GetLeader_FullMethodName:      {Roles: readers},
	kvcv1.AdminService_ListWorkers_FullMethodName:    {Roles: append(slices.Clone(readers), RoleGateway)},
	kvcv1.AdminService_GetWorker_FullMethodName:      {Roles: readers},
	kvcv1.AdminService_ListSessions_FullMethodName:   {Roles: readers},
	kvcv1.AdminService_GetSession_FullMethodName:     {Roles: readers},
	kvcv1.AdminService_GetPolicy_FullMethodName:      {Roles: readers},
	kvcv1.AdminService_UpdatePolicy_FullMethodName:   {Roles: []Role{RoleOperatorAdmin}},
	kvcv1.AdminService_DrainWorker_FullMethodName:    {Roles: []Role{RoleOperatorAdmin}},
	kvcv1.AdminService_GetDrainStatus_FullMethodName: {Roles: readers},
	kvcv1.AdminService_ForgetWorker_FullMethodName:   {Roles: []Role{RoleOperatorAdmin}},
	// Sidecar ↔ sidecar.
	kvcv1.TransferPeerService_OfferReceive_FullMethodName:    {Roles: []Role{RoleSidecar}},
	kvcv1.TransferPeerService_TransferDone_FullMethodName:    {Roles: []Role{RoleSidecar}},
	kvcv1.TransferPeerService_ReserveSnapshot_FullMethodName: {Roles: []Role{RoleSidecar}},
	kvcv1.TransferPeerService_CommitSnapshot_FullMethodName:  {Roles: []Role{RoleSidecar}},
	kvcv1.TransferPeerService_AbortSnapshot_FullMethodName:   {Roles: []Role{RoleSidecar}},
	kvcv1.TransferPeerService_SnapshotTokens_FullMethodName:  {Roles: []Role{RoleSidecar}},
	// Sidecar ↔ its own worker over a 0600 Unix socket: no role may call it over TLS.
	kvcv1.WorkerBridgeService_RegisterKVPool_FullMethodName: noTLSUse,
	kvcv1.WorkerBridgeService_CommitSession_FullMethodName:  noTLSUse,
	kvcv1.WorkerBridgeService_ReleaseSession_FullMethodName: noTLSUse,
	kvcv1.WorkerBridgeService_PrepareReceive_FullMethodName: noTLSUse,
	kvcv1.WorkerBridgeService_WaitReceive_FullMethodName:    noTLSUse,
	kvcv1.WorkerBridgeService_SendKV_FullMethodName:         noTLSUse,
	kvcv1.WorkerBridgeService_SnapshotStatus_FullMethodName: noTLSUse,
	kvcv1.WorkerBridgeService_WatchCommands_FullMethodName:  noTLSUse,
	kvcv1.WorkerBridgeService_AckCommand_FullMethodName:     noTLSUse,
	kvcv1.WorkerBridgeService_LoadFromStore_FullMethodName:  noTLSUse,
	kvcv1.WorkerBridgeService_ReportDemand_FullMethodName:   noTLSUse,
	// Every server.
	healthpb.Health_Check_FullMethodName:                                   anyPeer,
	healthpb.Health_List_FullMethodName:                                    anyPeer,
	healthpb.Health_Watch_FullMethodName:                                   anyPeer,
	reflectionv1.ServerReflection_ServerReflectionInfo_FullMethodName:      anyPeer,
	reflectionv1alpha.ServerReflection_ServerReflectionInfo_FullMethodName: anyPeer,
}

// Authorize decides one call: nil, or a PERMISSION_DENIED / UNAUTHENTICATED status naming the
// role and the method.
func Authorize(method string, leaf *x509.Certificate) error {
	if leaf == nil {
		return status.Errorf(codes.Unauthenticated, "%s: no verified client certificate", method)
	}
	rule, ok := Table[method]
	if !ok {
		return status.Errorf(codes.PermissionDenied, "%s: method not in the authorization table (denied by default)", method)
	}
	if rule.AnyPeer {
		return nil
	}
	role, err := RoleOf(leaf)
	if err != nil {
		return status.Errorf(codes.PermissionDenied, "%s: %v", method, err)
	}
	if !slices.Contains(rule.Roles, role) {
		return status.Errorf(codes.PermissionDenied, "role %q may not call %s (allowed: %s)", role, method, rolesText(rule))
	}
	return nil
}

// PeerCertificate is the verified client certificate of the call in ctx (nil if none).
func PeerCertificate(ctx context.Context) *x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return nil
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil
	}
	return ti.State.VerifiedChains[0][0]
}

// Authorizer is the per-method check as gRPC interceptors.
type Authorizer struct{ log zerolog.Logger }

// NewAuthorizer logs denials to log.
func NewAuthorizer(log zerolog.Logger) *Authorizer { return &Authorizer{log: log} }

func (a *Authorizer) check(ctx context.Context, method string) error {
	leaf := PeerCertificate(ctx)
	err := Authorize(method, leaf)
	if err != nil {
		ev := a.log.Warn().Str("method", method).Str("reason", status.Convert(err).Message())
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			ev = ev.Str("peer", p.Addr.String())
		}
		if leaf != nil {
			ev = ev.Str("subject", leaf.Subject.CommonName)
		}
		ev.Msg("call denied")
	}
	return err
}

// Unary checks unary calls.
func (a *Authorizer) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := a.check(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

// Stream checks streaming calls.
func (a *Authorizer) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := a.check(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return h(srv, ss)
}

func rolesText(r Rule) string {
	if r.AnyPeer {
		return "any authenticated peer"
	}
	if len(r.Roles) == 0 {
		return "none"
	}
	s := make([]string, len(r.Roles))
	for i, x := range r.Roles {
		s[i] = string(x)
	}
	return strings.Join(s, ", ")
}

// MarkdownTable renders Table for docs/operations.md (a test keeps the doc in step).
func MarkdownTable() string {
	methods := make([]string, 0, len(Table))
	for m := range Table {
		methods = append(methods, m)
	}
	sort.Strings(methods)
	var b strings.Builder
	b.WriteString("| method | allowed roles |\n|---|---|\n")
	for _, m := range methods {
		r := Table[m]
		txt := rolesText(r)
		if r.Note != "" && !r.AnyPeer {
			txt = "none — " + r.Note
		}
		fmt.Fprintf(&b, "| `%s` | %s |\n", m, txt)
	}
	return b.String()
}
