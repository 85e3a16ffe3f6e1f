package bench

import (
	"strings"
	"testing"
)

func TestArmPolicyAndSimArgs(t *testing.T) {
	tests := []struct {
		arm             string
		kvCentric       bool
		prefill, decode string
		wantErr         bool
	}{
		{arm: "E1"},
		{arm: "PD", prefill: "--prefix-cache-tokens 50000"},
		{arm: "SGL", prefill: "--prefix-cache-tokens 50000 --pull-dirs /w/tier-l3", decode: "--decode-radix --offload-dir /w/tier-l3 --restore-dirs /w/tier-l3"},
		{arm: "LLMD", prefill: "--prefix-cache-tokens 50000 --pull-dirs /w/tier-host-decode-0,/w/tier-host-decode-1",
			decode: "--offload-dir /w/tier-host-{worker} --offload-capacity-tokens 700"},
		{arm: "E3", kvCentric: true, prefill: "--prefix-cache-tokens 50000 --radix-eviction-policy priority"},
		{arm: "E4", kvCentric: true, prefill: "--prefix-cache-tokens 50000 --radix-eviction-policy priority", decode: "--evict watermark"},
		{arm: "E9", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.arm, func(t *testing.T) {
			pol, err := ArmPolicy(tt.arm)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err %v", err)
			}
			if err != nil {
				return
			}
			if pol.GetKvCentricEnabled() != tt.kvCentric || pol.GetSnapshotsEnabled() != (tt.arm == "E4") {
				t.Errorf("policy %v", pol)
			}
			p, d := ArmSimArgs(tt.arm, "/w", 2, Baselines{PrefillCapacity: 50000, HostTierTokens: 700})
			if got := strings.Join(p, " "); got != tt.prefill {
				t.Errorf("prefill %q, want %q", got, tt.prefill)
			}
			if got := strings.Join(d, " "); got != tt.decode {
				t.Errorf("decode %q, want %q", got, tt.decode)
			}
		})
	}
	if got := strings.Join(ArmDecodeSidecarArgs("E4"), " "); got != "--release-high-watermark 0.9" || ArmDecodeSidecarArgs("SGL") != nil {
		t.Errorf("decode sidecar args: E4 %q", got)
	}
	// Only the kvcentric arms' gateways resume a request whose decode worker died mid-stream.
	for _, arm := range Arms {
		want := "--resume-mid-stream=false"
		if arm == "E3" || arm == "E4" {
			want = ""
		}
		if got := strings.Join(ArmGatewayArgs(arm), " "); got != want {
			t.Errorf("%s's gateway args %q, want %q", arm, got, want)
		}
	}
	if p, _ := ArmSimArgs("PD", "/w", 1, Baselines{PrefixCacheTokens: 123, PrefillCapacity: 50000}); p[1] != "123" {
		t.Errorf("explicit prefix cache: %v", p)
	}
}

// TestArmPolicyForSeedThroughStore: --seed-through-store sets seed_through_store and
// --seed-through-store-when-short seed_through_store_when_short on E4's policy only; without
// them no arm has either.
func TestArmPolicyForSeedThroughStore(t *testing.T) {
	for _, arm := range Arms {
		for _, on := range []bool{false, true} {
			for _, short := range []bool{false, true} {
				pol, err := ArmPolicyFor(arm, on, short)
				if err != nil {
					t.Fatal(err)
				}
				if want := on && arm == "E4"; pol.GetSeedThroughStore() != want {
					t.Errorf("%s with %v/%v: seed_through_store %v, want %v", arm, on, short, pol.GetSeedThroughStore(), want)
				}
				if want := short && arm == "E4"; pol.GetSeedThroughStoreWhenShort() != want {
					t.Errorf("%s with %v/%v: seed_through_store_when_short %v, want %v", arm, on, short, pol.GetSeedThroughStoreWhenShort(), want)
				}
			}
		}
	}
	if _, err := ArmPolicyFor("E9", true, false); err == nil {
		t.Error("an unknown arm was accepted")
	}
}
