// Package flagenv forwards to pkg/flagenv, the one flag/environment helper of every binary; it
// remains only while kvc-bench still imports it.
package flagenv
