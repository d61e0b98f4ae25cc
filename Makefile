# Developer and CI entry points. CI runs `make test` through .ci/run.

SHELL := /bin/bash
CARGO ?= cargo

# Debian packages the workspace needs beyond the machine image: btrfs tools;
# libbtrfsutil and libclang (its bindgen build step) for the volume crate's
# optional `btrfsutil` backend, which `make test` cross-checks; compsize
# to cross-check usage figures, e2fsprogs for the ext4 fallback tests, attr and acl
# for the tests that set xattrs and ACLs; qemu-system-x86 and busybox-static for
# the power-cut guest (integration/tests/powercut.rs, which fetches Debian's
# cloud kernel itself with `apt-get download` into the cargo target dir); GNU
# time for the peak memory of a command (integration/tests/memory.rs, the bench);
# bindfs for a container whose root is a FUSE filesystem (integration/tests/mount_roots.rs).
APT_PACKAGES := btrfs-progs libbtrfsutil-dev libclang-dev btrfs-compsize e2fsprogs attr acl \
	qemu-system-x86 busybox-static time musl-tools bindfs
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

# Extra arguments for the bench binary, e.g. `make bench BENCH_ARGS="--extents 500000"`,
# or `BENCH_ARGS="--only loads --boot-small"`: the first boot through the call sites
# on the test suite's box, in about half a minute.
# The boot section runs the fixture's `call-sites` runner, built here beside it.
BENCH_ARGS ?=
# Extra arguments for the compare binary, e.g. `make compare COMPARE_ARGS="--only crash"`.
COMPARE_ARGS ?=
# Extra cargo arguments for `make test`, e.g. `CARGO_TEST_FLAGS=--release`.
CARGO_TEST_FLAGS ?=

# The command-line tools, which a library user (start-core) builds without.
# Defined before TEST_FEATURES: `:=` expands on the spot, so a later
# definition would leave the tests' builds without the CLIs.
CLI_FEATURES := volume/cli,volume-migrate/cli
# Failpoints (named SIGKILL sites for the crash tests) for every crate that has
# them; a production build has none.
TEST_FEATURES := volume/failpoints,volume-migrate/failpoints,startos-core/failpoints,$(CLI_FEATURES)

.PHONY: all deps build fmt-check clippy test faults bench demo targets dist guest-bins compare powercut

all: build

# Skips apt entirely when everything is installed, so repeated runs cost milliseconds.
# dpkg-query's status, rather than `dpkg -s` alone, because a removed package whose
# config files remain still makes `dpkg -s` succeed.
deps:
	@missing=""; \
	for pkg in $(APT_PACKAGES); do \
		[ "$$(dpkg-query -W -f='$${db:Status-Abbrev}' "$$pkg" 2>/dev/null)" = "ii " ] \
			|| missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "deps: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get update -qq \
			&& $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PACKAGES) >/dev/null; \
	fi

build: deps
	$(CARGO) build --workspace --all-targets --features $(CLI_FEATURES)

fmt-check:
	$(CARGO) fmt --all -- --check

clippy: deps
	$(CARGO) clippy --workspace --all-targets --features $(TEST_FEATURES) -- -D warnings

# Loop-mounted test filesystems are private to each test, so test threads can run in
# parallel; 4 keeps the 2-core machines busy while tests wait on I/O.
# The crash tests SIGKILL the process at named steps: `failpoints` compiles those
# steps in (a production build has none).
# The tests also run binaries of other packages (call-sites, the CLIs),
# which `cargo test` only builds for a package that has integration tests of its
# own: build every binary first, with the same features so nothing is rebuilt.
# The subvolume primitives run once more on the libbtrfsutil backend: the
# default build issues btrfs's ioctls itself, and both must agree.
test: deps fmt-check clippy guest-bins
	$(CARGO) build --workspace --bins --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS)
	$(CARGO) test --workspace --no-fail-fast --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS) -- --test-threads=4
	$(CARGO) test -p volume --features volume/btrfsutil --test sys_primitives $(CARGO_TEST_FLAGS)

# The whole I/O-error sweep: every system call of every operation made to
# fail, with each errno, once and for good (`make test` runs a sample).
faults: deps
	$(CARGO) build --workspace --bins --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS)
	FAULTS_FULL=1 $(CARGO) test -p integration --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS) --test faults --test faults_call_sites -- --test-threads=4 --nocapture

# The fuller power-cut sweep: every write state of every workload, more real
# cuts and more recoveries inside the guest (`make test` samples them).
powercut: deps guest-bins
	$(CARGO) build --workspace --bins --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS)
	POWERCUT_FULL=1 $(CARGO) test -p integration --features $(TEST_FEATURES) $(CARGO_TEST_FLAGS) --test powercut -- --test-threads=3 --nocapture

bench: deps
	$(CARGO) build --release --features $(CLI_FEATURES) -p volume --bin startos-volume -p volume-migrate --bin volume-migrate -p upstream-call-sites --bin call-sites && $(CARGO) run --release -p integration --bin bench -- $(BENCH_ARGS)

# The demo's updates run through start-core's own call sites: the fixture's
# `call-sites` runner, found beside the demo binary, built with its kill
# points (the demo pauses it at the old container's stop).
demo: deps
	$(CARGO) build --release -p upstream-call-sites --bin call-sites --features startos-core/failpoints && $(CARGO) run --release -p integration --bin demo

# What upstream's pipeline builds: start-core for macOS (start-cli), the
# crates for the musl targets of its static binaries. Checks each target whose
# standard library is installed (`rustup target add <target>` installs one) and
# names the others it skipped; it never downloads, so it never waits on the
# network. Not part of `make test`.
TARGETS := x86_64-apple-darwin x86_64-unknown-linux-musl aarch64-unknown-linux-musl \
	riscv64gc-unknown-linux-musl
targets:
	@installed="$$(rustup target list --installed)"; checked=0; \
	for t in $(TARGETS); do \
		if ! grep -qx "$$t" <<<"$$installed"; then \
			echo "targets: skipped $$t: its standard library is not installed (rustup target add $$t)"; \
			continue; \
		fi; \
		echo "targets: checking $$t"; \
		$(CARGO) check --target $$t -p startos-core -p upstream-call-sites -p volume -p volume-migrate \
			|| exit 1; \
		checked=$$((checked + 1)); \
	done; \
	echo "targets: $$checked of $(words $(TARGETS)) checked"

# The two command-line tools as static musl binaries, as an OS image takes
# them: dist/<target>/{startos-volume,volume-migrate} and dist/SHA256SUMS.
# x86_64 is required (its standard library is installed if missing: `make
# test` builds it first and runs the result, integration/tests/dist.rs);
# musl targets link statically by default; aarch64 and riscv64 are built where their standard
# libraries are installed, linked by the toolchain's own rust-lld (musl's
# start files ship with the target, so no cross C toolchain is needed).
DIST_DIR ?= dist
DIST_REQUIRED := x86_64-unknown-linux-musl
DIST_OPTIONAL := aarch64-unknown-linux-musl riscv64gc-unknown-linux-musl
DIST_BINS := startos-volume volume-migrate
dist: deps
	@grep -qx $(DIST_REQUIRED) <<<"$$(rustup target list --installed)" \
		|| rustup target add $(DIST_REQUIRED)
	@set -e; installed="$$(rustup target list --installed)"; rm -rf $(DIST_DIR); \
	for t in $(DIST_REQUIRED) $(DIST_OPTIONAL); do \
		if ! grep -qx "$$t" <<<"$$installed"; then \
			echo "dist: skipped $$t: its standard library is not installed (rustup target add $$t)"; \
			continue; \
		fi; \
		linker=""; \
		if [ "$$t" != "$(DIST_REQUIRED)" ]; then \
			linker="CARGO_TARGET_$$(tr 'a-z-' 'A-Z_' <<<"$$t")_LINKER=rust-lld"; \
		fi; \
		env $$linker $(CARGO) build --release \
			--target $$t --features $(CLI_FEATURES) -p volume --bin startos-volume \
			-p volume-migrate --bin volume-migrate; \
		mkdir -p $(DIST_DIR)/$$t; \
		for b in $(DIST_BINS); do cp "$${CARGO_TARGET_DIR:-target}/$$t/release/$$b" $(DIST_DIR)/$$t/; done; \
	done; \
	cd $(DIST_DIR) && sha256sum */* > SHA256SUMS && cat SHA256SUMS

# What the power-cut guest runs: static binaries only, as an OS image takes
# them, nothing of the host's copied in: startos-volume from `make dist`, and
# for the same target the workload (library calls the tools do not offer) and
# the fixture's call-sites runner (the finalize workload's start-core).
guest-bins: dist
	$(CARGO) build --release --target $(DIST_REQUIRED) -p integration --bin powercut-workload -p upstream-call-sites --bin call-sites

# Upstream's volume code (integration::upstream) against ours, scenario by
# scenario, in one table. The crash scenarios kill the binary's own child
# processes at named steps, so it is built with the failpoints; row h runs
# the fixture's call-sites runner, built beside it.
compare: deps
	$(CARGO) build --release -p upstream-call-sites --bin call-sites --features startos-core/failpoints
	$(CARGO) run --release -p integration --bin compare --features $(TEST_FEATURES) -- $(COMPARE_ARGS)
