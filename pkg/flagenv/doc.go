// Package flagenv is the one flag/environment helper of every kvcentric binary: a flag not given
// on the command line is taken from its environment variable, KVC_ plus the flag's name in upper
// snake case (--worker-id: KVC_WORKER_ID). The command line wins; an empty variable counts as
// unset; a bad value is an error naming the variable and the flag.
package flagenv
