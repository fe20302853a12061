// Command stargz-peer is stargz-snapshotter 0.12 as a containerd proxy snapshotter: the peer
// `coldstart bench` measures beside coldstart. Debian ships the library but not upstream's
// cmd/containerd-stargz-grpc, and its service/resolver packages need k8s.io/cri-api, which Debian
// lacks; so this main does what service.NewStargzSnapshotterService does with upstream's default
// config: fs.NewFilesystem (prefetch and background fetch on, memory metadata store, sources
// from the default labels) + snapshot.NewSnapshotter(..., snapshot.AsynchronousRemove), served
// by containerd's contrib/snapshotservice on a unix socket. Registry hosts are resolved like
// resolver.RegistryHostsFromConfig (no mirrors): retrying client, 30 s per request, the docker
// config keychain, plain HTTP for loopback hosts (docker.MatchLocalhost, so 127.0.0.1:PORT).
// Not here: config file, metrics/debug listeners, CRI/kubeconfig keychains. Unlike upstream
// (cleanup on SIGINT only), SIGTERM cleans up too: every layer is unmounted before exit.
//
// Build: GO111MODULE=off GOPATH=$PWD/gopath:/usr/share/gocode go build -o stargz-peer .
package main

import (
	"context"
	"flag"
	golog "log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/log"
	"github.com/containerd/containerd/reference"
	"github.com/containerd/containerd/remotes/docker"
	"github.com/containerd/containerd/snapshots/overlay/overlayutils"
	"github.com/containerd/stargz-snapshotter/fs"
	fsconfig "github.com/containerd/stargz-snapshotter/fs/config"
	"github.com/containerd/stargz-snapshotter/fs/layer"
	"github.com/containerd/stargz-snapshotter/fs/source"
	"github.com/containerd/stargz-snapshotter/snapshot"
	dockercfg "github.com/docker/cli/cli/config"
	rhttp "github.com/hashicorp/go-retryablehttp"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
)

// dockerCreds is stargz's dockerconfig keychain: ~/.docker/config.json, if any.
func dockerCreds(host string) (string, string, error) {
	cf, err := dockercfg.Load("")
	if err != nil {
		return "", "", nil
	}
	if host == "docker.io" || host == "registry-1.docker.io" {
		host = "https://index.docker.io/v1/"
	}
	ac, err := cf.GetAuthConfig(host)
	if err != nil {
		return "", "", err
	}
	if ac.IdentityToken != "" {
		return "", ac.IdentityToken, nil
	}
	return ac.Username, ac.Password, nil
}

// registryHosts is resolver.RegistryHostsFromConfig with an empty config.
func registryHosts(ref reference.Spec) ([]docker.RegistryHost, error) {
	client := rhttp.NewClient()
	client.Logger = nil // upstream: do not log every request
	tr := client.StandardClient()
	tr.Timeout = 30 * time.Second
	host := docker.RegistryHost{
		Client: tr, Host: ref.Hostname(), Scheme: "https", Path: "/v2",
		Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve,
		Authorizer: docker.NewDockerAuthorizer(docker.WithAuthClient(tr),
			docker.WithAuthCreds(dockerCreds)),
	}
	if local, _ := docker.MatchLocalhost(host.Host); local {
		host.Scheme = "http"
	}
	if host.Host == "docker.io" {
		host.Host = "registry-1.docker.io"
	}
	return []docker.RegistryHost{host}, nil
}

func main() {
	root := flag.String("root", "/var/lib/stargz-peer", "root directory of the snapshotter")
	address := flag.String("address", "/run/stargz-peer/stargz.sock", "unix socket to serve on")
	logLevel := flag.String("log-level", "info", "trace, debug, info, warn, error")
	flag.Parse()

	lvl, err := logrus.ParseLevel(*logLevel)
	if err != nil {
		logrus.WithError(err).Fatal("bad -log-level")
	}
	logrus.SetLevel(lvl)
	logrus.SetFormatter(&logrus.JSONFormatter{TimestampFormat: log.RFC3339NanoFixed})
	ctx := log.WithLogger(context.Background(), log.L)
	golog.SetOutput(log.G(ctx).WriterLevel(logrus.DebugLevel)) // go-fuse logs via std log

	snRoot := filepath.Join(*root, "snapshotter")
	if err := overlayutils.Supported(snRoot); err != nil {
		log.G(ctx).WithError(err).Fatalf("overlayfs is not supported on %q", snRoot)
	}
	opq := layer.OverlayOpaqueTrusted
	if userxattr, err := overlayutils.NeedsUserXAttr(snRoot); err == nil && userxattr {
		opq = layer.OverlayOpaqueUser
	}
	stargz, err := fs.NewFilesystem(filepath.Join(*root, "stargz"), fsconfig.Config{},
		fs.WithGetSources(source.FromDefaultLabels(registryHosts)),
		fs.WithOverlayOpaqueType(opq), fs.WithMetricsLogLevel(logrus.InfoLevel))
	if err != nil {
		log.G(ctx).WithError(err).Fatal("failed to configure the filesystem")
	}
	rs, err := snapshot.NewSnapshotter(ctx, snRoot, stargz, snapshot.AsynchronousRemove)
	if err != nil {
		log.G(ctx).WithError(err).Fatal("failed to create the snapshotter")
	}

	rpc := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(rpc, snapshotservice.FromSnapshotter(rs))
	if err := os.MkdirAll(filepath.Dir(*address), 0o700); err != nil {
		log.G(ctx).WithError(err).Fatal("failed to create the socket's directory")
	}
	_ = os.RemoveAll(*address)
	l, err := net.Listen("unix", *address)
	if err != nil {
		log.G(ctx).WithError(err).Fatalf("failed to listen on %q", *address)
	}
	errCh := make(chan error, 1)
	go func() { errCh <- rpc.Serve(l) }()
	log.G(ctx).WithField("address", *address).Info("serving")

	sigCh := make(chan os.Signal, 1)
	signal.Notify(sigCh, unix.SIGINT, unix.SIGTERM)
	select {
	case s := <-sigCh:
		log.G(ctx).Infof("got %v, cleaning up", s)
	case err := <-errCh:
		log.G(ctx).WithError(err).Error("gRPC server stopped")
	}
	rpc.Stop()
	if err := rs.Close(); err != nil { // unmounts every layer, committed ones included
		log.G(ctx).WithError(err).Warn("failed to close the snapshotter")
	}
	log.G(ctx).Info("exiting")
}
