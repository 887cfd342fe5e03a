// A real OpenID provider for the console's single sign-on tests (tests/console/test_sso_oidc.py): panva's
// oidc-provider 9 (OpenID Certified), with a password login page of its own and one client, the console.
// Started by the test with `node provider.mjs CONFIG.json`; its people (password, email, groups) are read from
// the users file at every login, so that a test can take someone out of a group between two logins.
import { readFileSync } from 'node:fs';
import Provider from 'oidc-provider';

const conf = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const people = () => JSON.parse(readFileSync(conf.users_file, 'utf8'));
const escape = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

const provider = new Provider(conf.issuer, {
  clients: [{
    client_id: conf.client_id,
    client_secret: conf.client_secret,
    redirect_uris: [conf.redirect_uri],
    post_logout_redirect_uris: [conf.post_logout_redirect_uri],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_post',
  }],
  pkce: { required: () => true }, // S256 only (the library's default methods)
  scopes: ['openid', 'email', 'profile', 'groups'],
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['preferred_username', 'name'],
    groups: ['groups'],
  },
  async findAccount(ctx, id) {
    const person = people()[id];
    if (!person) return undefined;
    return {
      accountId: id,
      async claims() {
        return {
          sub: id, preferred_username: id, name: person.name || id, email: person.email, email_verified: true,
          groups: person.groups,
        };
      },
    };
  },
  // The console is this provider's own client: what it asks for is granted without a consent page.
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope('openid email profile groups');
    grant.addOIDCClaims(['preferred_username', 'email', 'groups']);
    await grant.save();
    return grant;
  },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  features: { devInteractions: { enabled: false }, rpInitiatedLogout: { enabled: true } },
  cookies: { keys: [conf.cookie_key] },
});

async function formBody(req) {
  let raw = '';
  for await (const chunk of req) raw += chunk;
  return new URLSearchParams(raw);
}

const page = (uid, error) => `<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Test IdP sign-in</title></head>
<body><main><h1>Test IdP</h1>${error ? `<p role="alert">${escape(error)}</p>` : ''}
<form method="post" action="/interaction/${escape(uid)}/login">
<label>Username <input name="login" autocomplete="username" required></label>
<label>Password <input type="password" name="password" autocomplete="current-password" required></label>
<button type="submit">Sign in</button></form></main></body></html>`;

provider.use(async (ctx, next) => {
  const match = ctx.path.match(/^\/interaction\/([^/]+)(\/login)?$/);
  if (!match) return next();
  const details = await provider.interactionDetails(ctx.req, ctx.res);
  if (details.uid !== match[1]) ctx.throw(400, 'interaction mismatch');
  if (ctx.method === 'GET' && !match[2]) {
    ctx.type = 'html';
    ctx.body = page(details.uid);
    return undefined;
  }
  if (ctx.method !== 'POST' || !match[2]) ctx.throw(405);
  const form = await formBody(ctx.req);
  const person = people()[form.get('login')];
  if (!person || person.password !== form.get('password')) {
    ctx.type = 'html';
    ctx.body = page(details.uid, 'Wrong username or password.');
    return undefined;
  }
  const redirectTo = await provider.interactionResult(ctx.req, ctx.res, { login: { accountId: form.get('login') } },
    { mergeWithLastSubmission: false });
  ctx.redirect(redirectTo);
  return undefined;
});

provider.listen(conf.port, '127.0.0.1', () => console.log(`listening ${conf.issuer}`));
