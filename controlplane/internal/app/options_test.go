package app

import (
	"bytes"
	"flag"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

func TestEnvAndFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		check   func(o *Options) bool
		wantErr string
	}{
		{"defaults", nil, nil, func(o *Options) bool { return o.ElectionTTL == 5*time.Second && o.EtcdPrefix == "/kvc/v1/" }, ""},
		{"env sets", nil, map[string]string{"KVC_ELECTION_TTL": "3s", "KVC_NODE_ID": "cp-9", "KVC_ETCD_ENDPOINTS": "http://a:2379, b:2379"},
			func(o *Options) bool {
				return o.ElectionTTL == 3*time.Second && o.NodeID == "cp-9" && len(o.Endpoints()) == 2
			}, ""},
		{"flag wins", []string{"--node-id", "flag"}, map[string]string{"KVC_NODE_ID": "env"},
			func(o *Options) bool { return o.NodeID == "flag" }, ""},
		{"bad env value", nil, map[string]string{"KVC_SESSION_TTL": "forever"}, nil, "KVC_SESSION_TTL"},
		{"KVC_INSECURE", nil, map[string]string{"KVC_INSECURE": "true"}, func(o *Options) bool { return o.TLS.Insecure && o.Validate() == nil }, ""},
		{"env quota", nil, map[string]string{"KVC_EMBEDDED_ETCD_QUOTA_BYTES": "33554432", "KVC_EMBEDDED_ETCD_COMPACTION_RETENTION": "1h"},
			func(o *Options) bool { return o.EmbeddedEtcdQuota == 32<<20 && o.EmbeddedEtcdCompaction == time.Hour }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			o.AddFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := flagenv.Apply(fs, func(k string) string { return tc.env[k] })
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.check(o) {
				t.Fatalf("options %+v", o)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(o *Options)
		want string
	}{
		{"ok", func(o *Options) {}, ""},
		{"empty node id", func(o *Options) { o.NodeID = "" }, "--node-id"},
		{"slash in node id", func(o *Options) { o.NodeID = "a/b" }, "--node-id"},
		{"bad grpc addr", func(o *Options) { o.GRPCAddr = "nope" }, "--grpc-addr"},
		{"ttl below 2s", func(o *Options) { o.ElectionTTL = time.Second }, "--election-ttl"},
		{"ttl fractional", func(o *Options) { o.ElectionTTL = 2500 * time.Millisecond }, "--election-ttl"},
		{"prefix", func(o *Options) { o.EtcdPrefix = "kvc" }, "--etcd-prefix"},
		{"embedded needs data dir", func(o *Options) { o.DataDir = "" }, "--data-dir"},
		{"external needs no data dir", func(o *Options) { o.DataDir = ""; o.EtcdEndpoints = "127.0.0.1:2379" }, ""},
		{"bad endpoint", func(o *Options) { o.EtcdEndpoints = "nohostport" }, "--etcd-endpoints"},
		{"negative grace", func(o *Options) { o.UnreachableGrace = -time.Second }, "--unreachable-grace"},
		{"log format", func(o *Options) { o.LogFormat = "xml" }, "--log-format"},
		{"renew deadline at the ttl", func(o *Options) { o.ElectionRenewDeadline = o.ElectionTTL }, "--election-renew-deadline"},
		{"renew deadline negative", func(o *Options) { o.ElectionRenewDeadline = -time.Second }, "--election-renew-deadline"},
		{"renew deadline below the ttl", func(o *Options) { o.ElectionRenewDeadline = 4 * time.Second }, ""},
		{"keepalive time below 1s", func(o *Options) { o.GRPCKeepaliveTime = 500 * time.Millisecond }, "--grpc-keepalive-time"},
		{"keepalive timeout zero", func(o *Options) { o.GRPCKeepaliveTimeout = 0 }, "--grpc-keepalive-timeout"},
		{"tls all three", func(o *Options) { o.TLS = tlsx.Files{Cert: "c", Key: "k", CA: "a"} }, ""},
		{"neither tls nor --insecure", func(o *Options) { o.TLS.Insecure = false }, "or --insecure for plaintext"},
		{"tls and --insecure", func(o *Options) { o.TLS.Cert, o.TLS.Key, o.TLS.CA = "c", "k", "a" }, "--insecure contradicts"},
		{"embedded quota too small", func(o *Options) { o.EmbeddedEtcdQuota = 1 << 20 }, "--embedded-etcd-quota-bytes"},
		{"quota ignored with external etcd", func(o *Options) { o.EmbeddedEtcdQuota = 1; o.EtcdEndpoints = "127.0.0.1:2379" }, ""},
		{"compaction below 1s", func(o *Options) { o.EmbeddedEtcdCompaction = time.Millisecond }, "--embedded-etcd-compaction-retention"},
		{"compaction off", func(o *Options) { o.EmbeddedEtcdCompaction = 0 }, ""},
		{"etcd call timeout", func(o *Options) { o.EtcdCallTimeout = time.Millisecond }, "--etcd-call-timeout"},
		{"new-session share above 1", func(o *Options) { o.NewSessionShare = 1.5 }, "--new-session-share"},
		{"new-session share negative", func(o *Options) { o.NewSessionShare = -0.1 }, "--new-session-share"},
		{"new-session share NaN", func(o *Options) { o.NewSessionShare = math.NaN() }, "--new-session-share"},
		{"new-session share off", func(o *Options) { o.NewSessionShare = 0 }, ""},
		{"rehome fill above 1", func(o *Options) { o.RehomeFill = 1.2 }, "--rehome-fill"},
		{"rehome fill NaN", func(o *Options) { o.RehomeFill = math.NaN() }, "--rehome-fill"},
		{"rehome fill off", func(o *Options) { o.RehomeFill = 0 }, ""},
		{"tls without ca", func(o *Options) { o.TLS = tlsx.Files{Cert: "c", Key: "k"} }, "--tls-ca missing"},
		{"etcd tls needs external etcd", func(o *Options) { o.EtcdTLS.Cert, o.EtcdTLS.Key, o.EtcdTLS.CA = "c", "k", "a" }, "need --etcd-endpoints"},
		{"etcd tls partial", func(o *Options) { o.EtcdEndpoints = "https://e:2379"; o.EtcdTLS.CA = "a" }, "--etcd-cert, --etcd-key missing"},
		{"etcd tls external", func(o *Options) {
			o.EtcdEndpoints = "https://e:2379"
			o.EtcdTLS.Cert, o.EtcdTLS.Key, o.EtcdTLS.CA = "c", "k", "a"
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			o.NodeID = "cp"
			o.TLS.Insecure = true
			tc.mod(o)
			err := o.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
		})
	}
}

func TestMainBadFlagsExit2(t *testing.T) {
	for _, args := range [][]string{
		{"--no-such-flag"},
		{"--election-ttl", "1s"},
		{"--grpc-addr", "bad"},
		{"extra-arg"},
		{"--tls-cert", "c.pem"},
		{"--node-id", "cp"}, // neither TLS nor --insecure
	} {
		var buf bytes.Buffer
		if code := Main(args, &buf); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, buf.String())
		}
		if buf.Len() == 0 {
			t.Errorf("%v: no message", args)
		}
	}
}
